"""Causal self-attention over a KV cache addressed by slots, shared by prefill and decode.

A step lays the new tokens of B sequences one after another in a flat batch of T tokens (a whole prompt,
a chunk of one, or one decode token each). A layer's K (and V) cache is ``(num_blocks, block_size, H_kv,
D)``; token p of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
Each sequence's ``Lq`` new queries attend to exactly its ``Lk`` keys (cached + new) under an ``(Lq, Lk)``
causal mask: nothing is padded to the longest sequence of the step.

Shapes: T new tokens, B sequences, Lq / Lk one sequence's new tokens / keys, H / H_kv query / KV heads on
this rank, D head_dim.
"""
import torch
import torch.nn.functional as F
from torch import nn

from tplab.layers.attend_method import AttendsDecodesTogether, AttendsPaddedDecodes
from tplab.layers.metadata import AttentionMetadata


def plain_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale, hidden where not visible) v`` for one sequence, with GQA: the contract of
    ``Parts.attend`` (tplab's is ``sdpa_attend``, the same answer, faster: ``tplab.kernels.attend``).

    q ``(H, Lq, D)``; k, v ``(H_kv, Lk, D)``: query heads ``g * H/H_kv .. (g+1) * H/H_kv - 1`` share KV
    head g; visible ``(Lq, Lk)`` bool, ``causal_visible(Lq, Lk)``. Returns ``(H, Lq, D)``. The caller never
    copies the KV heads to H (the cache never holds the repeats). May be called with views (any strides)."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=visible,
                                          scale=scale, enable_gqa=True)[0]


class Attention(nn.Module):
    """One layer's attention on one rank: stores this step's K/V in the paged cache, then attends
    from each sequence's new queries to its keys.

    ``Attention(num_heads, num_kv_heads, head_dim, attend=plain_attend)``: this rank's H query heads
    and H_kv KV heads (``H`` a multiple of ``H_kv``), each of ``head_dim`` D; ``attend`` is
    ``Parts.attend``, called once per sequence per step (``plain_attend`` is its contract), except that an
    ``attend`` that is ``AttendsDecodesTogether`` (tplab's own) is handed the whole step instead.

    ``forward(q, k, v, kv_cache, meta)``:
      - q ``(T, H, D)``, k and v ``(T, H_kv, D)``: the step's new tokens, RoPE already applied;
      - ``kv_cache``: this layer's ``(k_cache, v_cache)``, each ``kv_cache_shape(...)``, i.e.
        ``(num_blocks, block_size, H_kv, D)``, written in place;
      - ``meta``: the step's ``AttentionMetadata``.
    It writes k, v (the KV heads, not repeated to H) to slots ``meta.slot_mapping``, then, for each
    sequence b, attends its queries ``q[query_start_loc[b]:query_start_loc[b + 1]]`` to the keys
    and values in ``meta.seq_kv_slots(b)`` under ``meta.visible[b]``. Returns ``(T, H * D)``, the
    tokens in the order they came.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, attend=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.attend = plain_attend if attend is None else attend

    def forward(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        # q (T, H, D); k, v (T, H_kv, D); each cache (num_blocks, block_size, H_kv, D)
        k_cache, v_cache = (c.flatten(0, 1) for c in kv_cache)      # (num_slots, H_kv, D) views (the cache is
                                                                    # contiguous: the writes land in it)
        k_cache.index_copy_(0, meta.slot_mapping, k)                # store the KV heads, not repeated ones
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if isinstance(self.attend, AttendsDecodesTogether):         # it takes the whole step (tplab's own, which
                                                                    # hands the prefills back to attend_each)
            return self.attend.attend_step(self, q, kv_cache, meta).flatten(1)
        return self.attend_each(q, kv_cache, meta, range(meta.num_seqs), torch.empty_like(q)).flatten(1)

    def attend_each(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    seqs, out: torch.Tensor) -> torch.Tensor:
        """Each sequence b of ``seqs`` alone: its queries ``q[query_start_loc[b]:query_start_loc[b + 1]]``
        against exactly its keys, under ``meta.visible[b]``, into the same rows of ``out`` ``(T, H, D)``."""
        k_cache, v_cache = (c.flatten(0, 1) for c in kv_cache)      # (num_slots, H_kv, D) views
        qs = meta.query_start_loc
        for b in seqs:
            slots = meta.seq_kv_slots(b)                            # (Lk,) exactly this sequence's keys
            o = self.attend(q[qs[b]:qs[b + 1]].transpose(0, 1),                    # (H, Lq, D)
                            k_cache.index_select(0, slots).transpose(0, 1),        # (H_kv, Lk, D)
                            v_cache.index_select(0, slots).transpose(0, 1),
                            meta.visible[b], self.scale)                           # -> (H, Lq, D)
            out[qs[b]:qs[b + 1]] = o.transpose(0, 1)
        return out                                                  # (T, H, D), the tokens in the order they came

    # What the engine asks of an attention part before it builds one

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this attention cannot run an engine on ``device`` in ``dtype`` with heads of ``head_dim``, or
        None. Where it cannot, the engine builds this class, tplab's, instead and says why (before any rank
        starts: ``tplab.engine.parts.for_device``). tplab's runs everywhere; a part tied to a kernel says where
        it does not."""
        return None

    @classmethod
    def takes_padded_decodes(cls, attend) -> bool:
        """Whether this attention, with ``attend``, runs a decode step at fixed shapes (``PaddedDecode``):
        ``forward`` hands the step to ``attend``, so it can when ``attend`` says so. A part whose ``forward``
        does not use its ``attend`` says for itself."""
        return isinstance(attend, AttendsPaddedDecodes)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) cache that ``forward`` expects, as a vLLM attention
        backend declares it: the KV heads only, never their repeats for the query heads."""
        return (num_blocks, block_size, num_kv_heads, head_dim)


def cache_shape_of(attention: type, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """One layer's K (and V) cache shape for the attention part ``attention`` (a class): its own
    ``kv_cache_shape`` when it is an ``Attention`` (which may declare another layout), else tplab's
    ``(num_blocks, block_size, H_kv, D)``, which any part written to ``Attention``'s contract reads."""
    shape_of = attention.kv_cache_shape if issubclass(attention, Attention) else Attention.kv_cache_shape
    return tuple(shape_of(num_blocks, block_size, num_heads, num_kv_heads, head_dim))
