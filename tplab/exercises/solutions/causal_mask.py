# Exercise: causal_mask (reference solution)
import torch


def causal_mask(q_len: int, k_len: int) -> torch.Tensor:
    """Query i is at position ``k_len - q_len + i`` and sees every key at or before it."""
    i = torch.arange(q_len)[:, None]                     # (q_len, 1)
    j = torch.arange(k_len)[None, :]                     # (1, k_len)
    return j <= (k_len - q_len) + i                      # (q_len, k_len) bool
