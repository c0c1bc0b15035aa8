# Exercise: repeat_kv (reference solution)
import torch


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each KV head serves ``n_rep`` consecutive query heads: copy it in place, ``n_rep`` times."""
    b, h_kv, t, d = k.shape
    k = k[:, :, None, :, :].expand(b, h_kv, n_rep, t, d)  # (B, H_kv, n_rep, T, D), a view: nothing copied yet
    return k.reshape(b, h_kv * n_rep, t, d)              # (B, H_kv * n_rep, T, D); = k.repeat_interleave(n_rep, 1)
