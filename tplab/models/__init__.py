"""Qwen2 in tensor-parallel form, and checkpoints to run it on."""
from tplab.models.checkpoints import save_random_qwen2, tiny_stories

__all__ = ["save_random_qwen2", "tiny_stories"]
