"""The KV cache tensors of one rank: per layer, K and V of shape ``(num_blocks, block_size, H_kv, D)``.

They hold this rank's KV heads only (``H_kv = num_kv_heads / tp_size``, or 1 when
KV heads are replicated), never the query-head repeats: GQA repeats K/V only
inside the score computation, so the cache is ``H / H_kv`` times smaller.
"""
import torch


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V tensors per layer, allocated once and written in place afterwards."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_cache_bytes(kv_caches) -> int:
    """Bytes held by a list of per-layer ``(k, v)`` caches."""
    return sum(t.numel() * t.element_size() for kv in kv_caches for t in kv)
