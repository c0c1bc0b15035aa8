"""Rotary position embedding (RoPE), computed the way HF Qwen2 computes it.

Shapes, with T tokens packed from all sequences of a step:
    positions: (T,)            the absolute position of each token in its sequence
    cos, sin:  (T, D)          D = head_dim; the two halves of the last dim are equal
    q:         (T, H, D)       rotated per head; cos/sin broadcast over H via (T, 1, D)
"""
import functools

import torch
from torch import nn


def rope_settings(config) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` from a Qwen2 config of transformers 4.x or 5.x."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return float(theta), rope_type


def check_rope_supported(config) -> None:
    """Refuse a rope scaling type we do not implement, instead of running with the wrong positions."""
    _, rope_type = rope_settings(config)
    if rope_type != "default":
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not implemented in tplab (only 'default' RoPE is). "
            "Remove rope scaling from the config, or use a checkpoint without it.")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q ``(T, H, D)`` and k ``(T, H_kv, D)`` by cos/sin ``(T, D)``.

    cos/sin get a head axis, ``(T, 1, D)``, so they broadcast over heads and line
    up with tokens. (HF keeps q as ``(B, H, T, D)`` and inserts the axis at dim 1.)
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _in_calling_thread(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with no intra-op worker thread taking part (the same kernel, so the same values)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(x)
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=8)
def _cos_sin_table(head_dim: int, max_position: int, base: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    # Same float ops as HF (arange in float, positions * inv_freq, cat), so fp32 matches bit for bit.
    # cos and sin run in the calling thread: built as a fresh process's first parallel op (a rank's, a
    # notebook kernel's), a worker thread's half of a table came out off on some CPUs (docs/numerics.md).
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)                         # (max_position, D)
    return _in_calling_thread(torch.cos, emb), _in_calling_thread(torch.sin, emb)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by the cos/sin of their positions, looked up in a table made once.

    Every layer's RotaryEmbedding shares one table (``max_position x D`` fp32 each for cos and sin:
    ``2 * 32768 * 64 * 4`` bytes, 16 MiB, for Qwen2.5-0.5B), rather than holding a copy per layer.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, apply_fn=apply_rotary):
        super().__init__()
        self.apply_fn = apply_fn
        device = str(torch.empty(0).device)   # the device being built on (llm_engine.build_model)
        cos, sin = _cos_sin_table(head_dim, max_position, float(base), device)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # rows of this layer's own: a rotation (a learner's, a pitfall's) may do with them what it likes
        cos = self.cos_cached.index_select(0, positions).to(q.dtype)     # (T, D)
        sin = self.sin_cached.index_select(0, positions).to(q.dtype)
        return self.apply_fn(q, k, cos, sin)
