"""Attention pitfalls: the causal mask, and what the KV cache holds.

Shape legend: H / H_kv query / KV heads on this rank, Lq / Lk new queries / keys of one sequence,
T new tokens in the step, D head_dim. ``Parts.attend`` is called once per sequence (see
``tplab.layers.attention.plain_attend``).
"""
import torch.nn.functional as F

from tplab.kernels.attend import sdpa_attend
from tplab.layers.attention import Attention


def mask_mul_inf_attend(q, k, v, visible, scale):
    """Causal mask built as ``triu(ones) * -inf`` and added to the scores.

    Review notes: "you use torch.ones(...) * -inf then add it to scores; the lower triangle
    becomes 0 * -inf = NaN, so scores contain NaN and softmax spreads it everywhere."
    """
    group = q.shape[0] // k.shape[0]                                # q (H, Lq, D), k, v (H_kv, Lk, D)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) * scale                        # (H, Lq, Lk)
    mask = (~visible).to(scores.dtype) * float("-inf")              # 1 * -inf = -inf, but 0 * -inf = NaN
    return F.softmax(scores + mask, dim=-1) @ v                     # (H, Lq, D)


def no_mask_with_cache_attend(q, k, v, visible, scale):
    """The causal mask applied only while the cache is empty: with cached keys, every key is visible.

    Review notes: "在 kv_cache is not None 时不再加 causal mask（你当前代码就是这样：mask 只在 kv_cache is None 时启用）
    ... 这条路径本身没问题" (no causal mask once there is a KV cache: the mask is only applied when kv_cache
    is None; this path by itself is fine). The student's condition, ``if kv_cache is None and seq_len > 1``,
    is per call; here it is per sequence: a sequence whose keys are all new this step (``Lq == Lk``) is
    masked, one with keys already cached (``Lq < Lk``) is not. It is harmless while every step after the
    prompt feeds one token (its one query may see every key), which was all the student's decode did. It
    is silently wrong as soon as a step feeds several new tokens after cached ones: a prefix-cache hit,
    a recomputation after preemption that hits the prefix cache, chunked prefill. Then each new token
    also attends to the new tokens after it.
    """
    lq, lk = visible.shape
    if lq == lk:                                                    # nothing cached: the causal mask
        return sdpa_attend(q, k, v, visible, scale)
    # "kv_cache is not None": no mask at all. (Not sdpa_attend: it relies on the mask being causal.)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                          scale=scale, enable_gqa=True)[0]     # (H, Lq, D)


class RepeatedKVAttention(Attention):
    """GQA attention that repeats K/V to the query head count *before* writing them to the cache.

    Review notes: "you repeat_interleave k/v to match Q heads, then return (k, v) as cache ... That will
    explode KV size". In tplab's paged cache, sized for this layout, the answers stay right (a repeated
    head holds the same numbers); its cache layout has ``H`` heads per token instead of ``H_kv``, so
    with a fixed ``num_kv_blocks`` ``llm.stats()["kv_cache_bytes"]`` is ``H / H_kv`` times larger
    (with a fixed memory budget, the cache holds ``H / H_kv`` times fewer tokens). The student's
    concatenated cache was not resized: there the next step's ``torch.cat`` of ``H`` cached heads
    with ``H_kv`` new ones fails (notebook 04).
    """

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_heads, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_heads, head_dim)        # a slot per query head

    def forward(self, q, k, v, kv_cache, meta):
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, H, D), cached so
        return super().forward(q, k, v, kv_cache, meta)
