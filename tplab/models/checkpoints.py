"""Checkpoints the workbook can use with no download: random Qwen2 models of any shape, and the
shipped tiny model trained on generated stories."""
from pathlib import Path

import torch

SMALL_QWEN2 = dict(  # small enough for many tests; GQA with 2 query heads per KV head
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, initializer_range=0.2, use_sliding_window=False,
)


def save_random_qwen2(out_dir, seed: int = 0, **overrides) -> Path:
    """Write a randomly initialised HF Qwen2 checkpoint (config.json, model.safetensors) to ``out_dir``.

    ``overrides`` are ``Qwen2Config`` fields. Every parameter is random, q/k/v biases and
    RMSNorm weights included (HF would leave them 0 and 1, which would hide a bug in
    loading them), and weights have std ``initializer_range`` (0.2 by default) so that
    greedy choices are clear-cut rather than near ties.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {**SMALL_QWEN2, **overrides}
    if "rope_theta" in settings:  # transformers 5 keeps it in rope_parameters
        settings.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": settings.pop("rope_theta")})
    config = Qwen2Config(**settings)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else config.initializer_range * noise)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def tiny_stories() -> Path:
    """The shipped tiny Qwen2 trained on generated short stories (HF folder with tokenizer)."""
    path = Path(__file__).parent / "tiny_stories"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped model is missing from {path}; retrain it with "
                                "scripts/tiny_stories/train.py (see the README)")
    return path
