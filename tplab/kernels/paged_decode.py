"""The decode tokens of a step, attended together block by block: paged attention for decode, in PyTorch ops.

A decode step has one query per sequence and sequences of any lengths. ``paged_decode`` gathers exactly the
KV blocks the decode sequences hold (``meta.decode``), scores every query against its own sequence's blocks
in one batched matmul, hides the unused slots, and does each sequence's softmax over its blocks with segment
reductions, as a paged-attention kernel does: a dozen ops a layer whatever the number of sequences, and the
same softmax summed in another order. That is the CPU's way; a GPU's decode step is bound by launching
kernels, so there ``dense_decode`` pads each sequence's blocks to the longest and makes one SDPA call a
layer (``SdpaAttend.attend_decodes``, ``tplab.kernels.attend``, picks by device).

Shapes: Bd decode sequences, nb blocks they hold in all, bs block_size, H / H_kv heads, G = H / H_kv
query heads per KV head, D head_dim.
"""
import torch
import torch.nn.functional as F

from tplab.kernels.decode_blocks import DecodeBlocks, PaddedDecode


def score_mask(dec: DecodeBlocks, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """``(nb, H, bs * H_kv)`` bool, True where a query head must not look: a slot past the end of
    its sequence, or a row of another KV head (a block's rows are (slot, KV head) pairs). A block is scored
    as it lies in the cache, ``(bs, H_kv, D)`` read as ``bs * H_kv`` rows: ``H_kv`` times the (tiny) score
    FLOPs, and no transpose of the gathered blocks, which costs more (at TP 2 and above a rank usually holds
    one KV head, and nothing is wasted)."""
    key = (num_heads, num_kv_heads)
    if key not in dec.per_step:
        device, bs = dec.past_end.device, dec.past_end.shape[-1]
        group = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)          # (H,)
        other_head = group[:, None] != torch.arange(num_kv_heads, device=device)              # (H, H_kv)
        mask = dec.past_end.view(-1, 1, bs, 1) | other_head[None, :, None, :]                  # (nb, H, bs, H_kv)
        dec.per_step[key] = mask.view(-1, num_heads, bs * num_kv_heads)
    return dec.per_step[key]


def padded_bias(dec: DecodeBlocks | PaddedDecode, dtype: torch.dtype) -> torch.Tensor:
    """For ``dense_decode`` and ``padded_decode``: ``padded_past_end`` as an additive mask, ``(Bd, 1, 1, L)`` in
    ``dtype``: 0 where a slot holds a key, -inf elsewhere. Made by the first layer of a step and read by the
    others, on the device (no host data is read inside the forward: on a GPU that would make the host wait)."""
    key = ("bias", dtype)
    if key not in dec.per_step:
        past_end = dec.padded_past_end
        bias = torch.zeros(past_end.shape, dtype=dtype, device=past_end.device).masked_fill_(past_end, float("-inf"))
        dec.per_step[key] = bias[:, None, None, :]
    return dec.per_step[key]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBlocks,
                 scale: float) -> torch.Tensor:
    """q ``(Bd, H, D)``, one query per decode sequence; caches ``(num_blocks, bs, H_kv, D)`` -> ``(Bd, H, D)``.
    The CPU's route (``SdpaAttend.attend_decodes`` sends a GPU's decodes to ``dense_decode``)."""
    bd, h, d = q.shape
    dtype = torch.float32                                          # scores and softmax in fp32, also for bf16
    if bd == 1:
        return _one_sequence(q, k_cache, v_cache, dec, scale, dtype)
    rows = k_cache.shape[1] * k_cache.shape[2]                     # bs * H_kv rows per block
    kb = k_cache.index_select(0, dec.blocks).view(-1, rows, d).to(dtype)   # (nb, bs*H_kv, D): only the blocks used
    vb = v_cache.index_select(0, dec.blocks).view(-1, rows, d).to(dtype)
    qb = q.to(dtype).index_select(0, dec.block_seq)                # (nb, H, D): each block's sequence's query
    s = torch.baddbmm(qb.new_empty(()), qb, kb.transpose(1, 2), beta=0, alpha=scale)  # (nb, H, bs*H_kv)
    masked = score_mask(dec, h, k_cache.shape[2])
    # reductions over each sequence's blocks (they lie one sequence after another). unsafe: the lengths, built
    # by decode_blocks and each >= 1, go unchecked (the check costs ops)
    per_seq = dict(lengths=dec.num_blocks, unsafe=True)
    m = torch.segment_reduce(s.masked_fill_(masked, float("-inf")).amax(-1), "max", **per_seq)     # (Bd, H)
    # exp of a score more than 80 below its row's max is under 2e-35, too small to change an fp32 sum
    # that holds the max's weight of 1; clamped there, exp never makes denormals (much slower)
    p = (s - m.index_select(0, dec.block_seq).unsqueeze(-1)).clamp_min_(-80.0).exp_().masked_fill_(masked, 0.0)
    den = torch.segment_reduce(p.sum(-1), "sum", **per_seq)                                      # (Bd, H)
    # index_add_: segment_reduce sums (nb, H, D) several times slower
    o = p.new_zeros(bd, h, d).index_add_(0, dec.block_seq, torch.bmm(p, vb))                     # (Bd, H, D)
    return (o / den.unsqueeze(-1)).to(q.dtype)


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBlocks,
                 scale: float) -> torch.Tensor:
    """``paged_decode`` as a GPU runs it best: the same inputs and result, in a few kernel launches a layer.

    On a GPU a decode step is bound by launching kernels, not by the bytes moved, and ``paged_decode`` takes
    dozens of launches a layer (its segment reductions and casts). Here each sequence's blocks are gathered
    into one padded row, ``(Bd, nb_max * bs, H_kv, D)``, and one SDPA call attends them under a mask that
    hides the padding (``padded_bias``, made once per step). GQA without repeating the KV heads:
    the G query heads of a KV head are viewed as G queries of one sequence (one decode query each, so no
    causal mask applies among them). SDPA computes in the query's dtype with fp32 softmax statistics, as
    HF's attention does. A single sequence needs no mask: its keys are sliced to its length.
    """
    if q.shape[0] == 1:                  # its keys sliced to its length: no mask
        n = dec.context_lens[0]
        k = k_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1)[None]   # (1, H_kv, Lk, D)
        v = v_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1)[None]
        return _gqa_sdpa(q, k, v, None, scale)
    return _padded_sdpa(q, k_cache, v_cache, dec.padded_blocks.view(-1), padded_bias(dec, q.dtype), scale)


def padded_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: PaddedDecode,
                  scale: float) -> torch.Tensor:
    """A decode step at fixed shapes (the step a CUDA graph replays): q ``(Bp, H, D)``, each row against the
    blocks of its padded table, ``(Bp, W * bs)`` keys, under a mask of its length made from the lengths'
    tensor once a step (no host value is read, so the same kernels serve every step of the bucket)
    -> ``(Bp, H, D)``."""
    return _padded_sdpa(q, k_cache, v_cache, dec.block_tables.reshape(-1), padded_bias(dec, q.dtype), scale)


def _padded_sdpa(q, k_cache, v_cache, table: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``(B, H, D)`` against the blocks ``table`` lists, W per row one row after another, read as
    ``(B, H_kv, W * bs, D)`` keys; ``bias`` ``(B, 1, 1, W * bs)`` hides each row's slots past its end."""
    b, (h_kv, d) = q.shape[0], k_cache.shape[2:]
    k = k_cache.index_select(0, table).view(b, -1, h_kv, d).transpose(1, 2)      # (B, H_kv, W * bs, D)
    v = v_cache.index_select(0, table).view(b, -1, h_kv, d).transpose(1, 2)
    return _gqa_sdpa(q, k, v, bias, scale)


def _gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, scale: float) -> torch.Tensor:
    """One SDPA call: q ``(B, H, D)``, one decode query per row, against k, v ``(B, H_kv, L, D)`` -> ``(B, H, D)``.
    GQA without repeating the KV heads: a KV head's G query heads are viewed as G queries of its row."""
    b, h, d = q.shape
    h_kv = k.shape[1]
    o = F.scaled_dot_product_attention(q.view(b, h_kv, h // h_kv, d), k, v, attn_mask=bias, scale=scale)
    return o.reshape(b, h, d)          # a GPU kernel may return (B, G, H_kv, D) in memory: reshape, not view


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head against one sequence's keys, which it sees all of: q ``(H, ..., D)`` holding
    H queries, k and v ``(H_kv, Lk, D)`` -> ``(H_kv, H / H_kv, D)``. GQA by viewing the query heads as
    ``(H_kv, G)``: each KV head's group is one small matmul, the KV heads never repeated. A decode step's
    attention, in two matmuls (faster on CPU than SDPA's kernel for one query); also ``sdpa_attend``'s."""
    h_kv, _, d = k.shape
    qg = q.reshape(h_kv, -1, d)                                      # (H_kv, G, D)
    scores = torch.baddbmm(qg.new_empty(()), qg, k.transpose(1, 2), beta=0, alpha=scale)   # (H_kv, G, Lk)
    return torch.bmm(scores.softmax(-1), v)


def _one_sequence(q, k_cache, v_cache, dec: DecodeBlocks, scale: float, dtype) -> torch.Tensor:
    """One decode sequence (a single request's decode): its blocks, in order, are its keys, so there is
    no per-block softmax to merge. Half the ops of the general path: at batch 1 their fixed cost is what
    a layer's attention is."""
    _, h, d = q.shape
    n = dec.context_lens[0]
    k = k_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1).to(dtype)   # (H_kv, Lk, D)
    v = v_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1).to(dtype)
    return one_query_attention(q.to(dtype), k, v, scale).view(1, h, d).to(q.dtype)
