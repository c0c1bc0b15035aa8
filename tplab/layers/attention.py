"""Causal self-attention over a KV cache addressed by slots, shared by prefill and decode.

A step packs the new tokens of B sequences one after another into a flat batch of T tokens
(a whole prompt, a chunk of one, or one decode token each). The KV cache of a layer is
``(num_blocks, block_size, H_kv, D)`` for K and for V; token p of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the flattened
``(num_blocks * block_size, H_kv, D)`` cache.

Attention runs sequence by sequence: the ``Lq`` new queries of one sequence against exactly
its ``Lk`` keys (cached + new), under an ``(Lq, Lk)`` causal mask. Nothing is padded to the
longest sequence of the step, so no score or mask tensor is larger than one sequence's
chunk needs, and a decode step reads only the slots its sequences hold.

Shape legend: T new tokens in the step, B sequences, Lq new tokens of one sequence, Lk its
keys (cached + new, ``Lk >= Lq``), N the keys of all B sequences, H query heads and H_kv KV
heads on this rank, D head_dim.
"""
import torch
import torch.nn.functional as F
from torch import nn

from tplab.layers.metadata import AttentionMetadata, build_metadata, causal_visible  # noqa: F401 (their old home)
from tplab.layers.paged_decode import DecodeBlocks, dense_decode, one_query_attention, paged_decode


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)   # absent in old torch


class AttendsDecodesTogether:
    """An ``attend`` (``Parts.attend``) that also attends every decode token of a step at once, over the
    blocks the decode sequences hold: ``Attention`` then hands it ``meta.decode`` instead of calling it
    once per decode sequence. A plain function is called once per sequence, every sequence."""

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       decode: DecodeBlocks, scale: float) -> torch.Tensor:
        """q ``(Bd, H, D)``, one query per decode sequence; caches ``(num_blocks, bs, H_kv, D)`` -> ``(Bd, H, D)``."""
        raise NotImplementedError


class SdpaAttend(AttendsDecodesTogether):
    """``sdpa_attend(q, k, v, visible, scale)``: ``softmax(q k^T * scale, hidden where not visible) v`` for
    one sequence, with GQA. tplab's ``Parts.attend``; it also attends every decode token of a step at once
    (``attend_decodes``: ``tplab.layers.paged_decode``; on a GPU, padded to one SDPA call, ``dense_decode``).

    q ``(H, Lq, D)``; k, v ``(H_kv, Lk, D)``: query heads ``g * H/H_kv .. (g+1) * H/H_kv - 1``
    share KV head g; visible ``(Lq, Lk)`` bool, ``causal_visible(Lq, Lk)``: the kernels below rely on
    that causal shape, so an ``attend`` with another mask must not hand it here. Returns ``(H, Lq, D)``.
    The caller never copies the KV heads to H (SDPA's math backend still repeats them internally;
    the cache never holds the repeats). May be called with views (any strides).

    A decode step (``Lq = 1``: one query at the last position, every key visible) is two small
    matmuls, faster on CPU than SDPA's kernel; a prefill whose keys are all new (``Lq = Lk``)
    uses SDPA's ``is_causal``, the same mask, which lets the kernel skip the hidden blocks; a chunk
    after cached keys is split in two (``_cached_then_causal``) for the same reason.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 scale: float) -> torch.Tensor:
        lk, d = k.shape[1:]
        if q.shape[1] == 1:
            return one_query_attention(q, k, v, scale).view(-1, 1, d)  # (H, 1, D)
        if q.shape[1] < lk and q.device.type == "cpu" and _FLASH_CPU is not None:
            return _cached_then_causal(q, k, v, scale)
        causal = q.shape[1] == lk
        return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                              attn_mask=None if causal else visible, is_causal=causal,
                                              scale=scale, enable_gqa=True)[0]

    def attend_decodes(self, q, k_cache, v_cache, decode, scale):
        # a CPU runs the segment reductions in C++ loops; a GPU would launch ~30 kernels a layer for them
        attend = paged_decode if q.device.type == "cpu" else dense_decode
        return attend(q, k_cache, v_cache, decode, scale)

    def __repr__(self):
        return "sdpa_attend"

    def __reduce__(self):
        return "sdpa_attend"       # pickled by name: a rank gets the one instance, and Parts() equals its own


sdpa_attend = SdpaAttend()   # tplab's Parts.attend: softmax(q k^T * scale, causal) v, GQA, decodes together


def _cached_then_causal(q, k, v, scale):
    """A chunk after ``P = Lk - Lq`` cached keys: every query sees all of them, and the chunk's own
    keys causally. One masked SDPA would compute every (query, key) pair of the chunk's square; two
    flash-attention calls (the cached keys unmasked, the chunk's own ``is_causal``) skip its hidden
    half, and their outputs merge exactly by their log-sum-exps: ``o = sum_i o_i exp(lse_i - lse)``."""
    p = k.shape[1] - q.shape[1]
    q4 = q.unsqueeze(0)                                              # (1, H, Lq, D)
    o1, lse1 = _FLASH_CPU(q4, k[None, :, :p], v[None, :, :p], 0.0, False, scale=scale)   # lse (1, H, Lq)
    o2, lse2 = _FLASH_CPU(q4, k[None, :, p:], v[None, :, p:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse1, lse2)
    out = o1.float() * (lse1 - lse).exp().unsqueeze(-1) + o2.float() * (lse2 - lse).exp().unsqueeze(-1)
    return out[0].to(q.dtype)                                        # (H, Lq, D)


class Attention(nn.Module):
    """One layer's attention on one rank: stores this step's K/V in the paged cache, then attends
    from each sequence's new queries to its keys.

    ``Attention(num_heads, num_kv_heads, head_dim, attend=sdpa_attend)``: this rank's H query heads
    and H_kv KV heads (``H`` a multiple of ``H_kv``), each of ``head_dim`` D; ``attend`` is
    ``Parts.attend``, called once per sequence per step (see ``sdpa_attend`` for its contract), except
    that an ``attend`` that is ``AttendsDecodesTogether`` (tplab's own) gets the decode tokens of all
    sequences at once (its ``attend_decodes``, from ``meta.decode``): the same maths in a dozen ops per
    layer instead of a few per sequence. A plain function sees every sequence.

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

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, attend=sdpa_attend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.attend = attend

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this attention cannot run an engine on ``device`` in ``dtype`` with heads of ``head_dim``, or
        None. Where it cannot, the engine builds this class, tplab's, instead and says why (``EngineConfig``,
        before any rank starts). tplab's runs everywhere; a part tied to a kernel says where it does not."""
        return None

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) cache that ``forward`` expects, as a vLLM attention
        backend declares it: the KV heads only, never their repeats for the query heads."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def forward(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        # q (T, H, D); k, v (T, H_kv, D); each cache (num_blocks, block_size, H_kv, D)
        k_cache, v_cache = (c.flatten(0, 1) for c in kv_cache)      # (num_slots, H_kv, D) views
        k_cache.index_copy_(0, meta.slot_mapping, k)                # store the KV heads, not repeated ones
        v_cache.index_copy_(0, meta.slot_mapping, v)
        together = meta.decode is not None and isinstance(self.attend, AttendsDecodesTogether)
        if together and len(meta.decode.seqs) == q.shape[0]:       # every token a decode: no gather
            return self.attend.attend_decodes(q, *kv_cache, meta.decode, self.scale).flatten(1)
        out = torch.empty_like(q)                                   # (T, H, D)
        if together:                                                # all decodes at once
            rows = meta.decode.token_index                          # (Bd,)
            out.index_copy_(0, rows, self.attend.attend_decodes(q.index_select(0, rows), *kv_cache, meta.decode,
                                                                self.scale))
        skip = set(meta.decode.seqs) if together else ()
        qs = meta.query_start_loc
        for b in range(meta.num_seqs):
            if b in skip:
                continue
            slots = meta.seq_kv_slots(b)                            # (Lk,) exactly this sequence's keys
            o = self.attend(q[qs[b]:qs[b + 1]].transpose(0, 1),                    # (H, Lq, D)
                            k_cache.index_select(0, slots).transpose(0, 1),        # (H_kv, Lk, D)
                            v_cache.index_select(0, slots).transpose(0, 1),
                            meta.visible[b], self.scale)                           # -> (H, Lq, D)
            out[qs[b]:qs[b + 1]] = o.transpose(0, 1)
        return out.flatten(1)                                       # (T, H * D)


def kv_cache_shape(attention: type, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """One layer's K (and V) cache shape for the attention part ``attention`` (a class): its own
    ``kv_cache_shape`` when it is an ``Attention`` (which may declare another layout), else tplab's
    ``(num_blocks, block_size, H_kv, D)``, which any part written to ``Attention``'s contract reads."""
    shape_of = attention.kv_cache_shape if issubclass(attention, Attention) else Attention.kv_cache_shape
    return tuple(shape_of(num_blocks, block_size, num_heads, num_kv_heads, head_dim))
