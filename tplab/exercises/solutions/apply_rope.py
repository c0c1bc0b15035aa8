# Exercise: apply_rope (reference solution)
import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Give cos/sin a head axis so they line up with tokens, then rotate the two halves of D."""
    cos, sin = cos[:, None, :], sin[:, None, :]          # (T, 1, D): same for every head
    x1, x2 = x.chunk(2, dim=-1)                          # (T, H, D/2) each
    rotated = torch.cat((-x2, x1), dim=-1)               # rotate_half: pairs (x_i, x_{i+D/2})
    return x * cos + rotated * sin                       # (T, H, D)
