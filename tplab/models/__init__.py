"""Qwen2, Qwen3 and their MoE variants in tensor-parallel form, and checkpoints to run them on."""
from tplab.models.checkpoints import (save_random_qwen2, save_random_qwen2_moe, save_random_qwen3, save_random_qwen3_moe,
                                      tiny_moe, tiny_stories)

__all__ = ["save_random_qwen2", "save_random_qwen3", "save_random_qwen2_moe", "save_random_qwen3_moe", "tiny_stories",
           "tiny_moe"]
