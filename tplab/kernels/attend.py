"""tplab's ``Parts.attend``, ``sdpa_attend``: ``plain_attend``'s answer (``tplab.layers.attention``), by the
fastest route for each shape of a sequence's step, and every decode token of a step at once.

- a decode (``Lq = 1``: one query at the last position, every key visible): two small matmuls, faster on
  CPU than SDPA's kernel (``one_query_attention``);
- a prefill whose keys are all new (``Lq = Lk``): SDPA's ``is_causal``, which skips the hidden blocks;
- a chunk after cached keys, on CPU: two flash-attention calls merged by their log-sum-exps
  (``_cached_then_causal``), which skip the hidden half of the chunk's square as well;
- the decode tokens of a step together (``AttendsDecodesTogether``): ``paged_decode`` on CPU, and on a GPU,
  whose decode step is bound by kernel launches, ``dense_decode`` (``tplab.kernels.paged_decode``); a step at
  fixed shapes (``PaddedDecode``, what a CUDA graph replays) by ``padded_decode``.
"""
import torch
import torch.nn.functional as F

from tplab.kernels.paged_decode import dense_decode, one_query_attention, padded_decode, paged_decode
from tplab.layers.attend_method import AttendsPaddedDecodes
from tplab.kernels.decode_blocks import DecodeBlocks, PaddedDecode, decode_blocks

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)   # absent in old torch


class SdpaAttend(AttendsPaddedDecodes):
    """``sdpa_attend(q, k, v, visible, scale)``: ``plain_attend``'s contract for one sequence (q ``(H, Lq, D)``;
    k, v ``(H_kv, Lk, D)`` -> ``(H, Lq, D)``), where ``visible`` is ``causal_visible(Lq, Lk)``: the routes
    above rely on that causal shape, so an ``attend`` with another mask must not hand it here. As
    ``AttendsDecodesTogether`` it takes a whole step and attends its decode tokens at once (``attend_decodes``)."""

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

    def decode_inputs(self, query_lens, context_lens, block_tables, block_size, device) -> DecodeBlocks | None:
        """The blocks the step's decode sequences hold, as tensors (None when none decodes)."""
        return decode_blocks(query_lens, context_lens, block_tables, block_size, device)

    def attend_step(self, layer, q, kv_cache, meta):
        """Every decode token at once (``attend_decodes``), then each other sequence alone (``layer.attend_each``)."""
        dec = meta.decode
        if isinstance(dec, PaddedDecode):                           # a step at fixed shapes: all padded decodes
            return padded_decode(q, *kv_cache, dec, layer.scale)
        if dec is None:
            return layer.attend_each(q, kv_cache, meta, range(meta.num_seqs), torch.empty_like(q))
        if len(dec.seqs) == q.shape[0]:                             # every token a decode: no gather
            return self.attend_decodes(q, *kv_cache, dec, layer.scale)
        out = torch.empty_like(q)                                   # (T, H, D)
        rows = dec.token_index                                      # (Bd,)
        out.index_copy_(0, rows, self.attend_decodes(q.index_select(0, rows), *kv_cache, dec, layer.scale))
        decodes = set(dec.seqs)
        return layer.attend_each(q, kv_cache, meta, [b for b in range(meta.num_seqs) if b not in decodes], out)

    def attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeBlocks,
                       scale: float) -> torch.Tensor:
        """q ``(Bd, H, D)``, one query per decode sequence; caches ``(num_blocks, bs, H_kv, D)`` -> ``(Bd, H, D)``."""
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
