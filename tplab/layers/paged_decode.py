"""The decode tokens of a step, attended together block by block: paged attention for decode.

A decode step has one query per sequence and sequences of any lengths. Attending them one by one
costs a few small ops per sequence and layer; padding them to the longest would read (and compute)
what no sequence holds. Here the step gathers exactly the KV blocks its decode sequences hold, scores
every query against the blocks of its own sequence only (one batched matmul: a block's slots against
its sequence's query), hides the unused slots of each sequence's last block, and does the softmax per
sequence over its blocks with segment reductions (max, then sum), as a paged-attention kernel does.
A dozen ops per layer, whatever the number of sequences, and exact: the same softmax, summed in
another order. A step with a single decode sequence takes a shorter path (``_one_sequence``): its
blocks, in order, are its keys, so there is nothing to merge.

That is the CPU's way. A GPU launches each of those ops as a kernel, and its decode step is bound by the
launches: there ``dense_decode`` pads each sequence's blocks to the longest and makes one SDPA call a layer
under a mask (``SdpaAttend.attend_decodes`` picks by device; both are held to the same reference).

A block is scored as it lies in the cache, ``(bs, H_kv, D)`` read as ``bs * H_kv`` rows: every query
head against every KV head's rows, the rows of the other KV heads then hidden. That costs ``H_kv``
times the (tiny) score FLOPs and saves transposing the gathered blocks, which cost more than the
matmuls (at TP 2 and above a rank usually holds one KV head, and nothing is wasted).

Shapes: Bd decode sequences, nb blocks they hold in all, bs block_size, H / H_kv heads, G = H / H_kv
query heads per KV head, D head_dim.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeBlocks:
    """Which KV blocks the decode sequences (query length 1) of a step hold. Built once per step."""
    seqs: list[int]               # Bd ints: index b of each decode sequence in the step
    token_index: torch.Tensor     # (Bd,) long: its token's row in the step's T tokens
    blocks: torch.Tensor          # (nb,) long: each decode sequence's blocks in order, one sequence after another
    block_seq: torch.Tensor       # (nb,) long: which decode sequence (0 .. Bd-1) each block belongs to
    num_blocks: torch.Tensor      # (Bd,) long: blocks per decode sequence
    context_lens: list[int]       # Bd ints: keys of each decode sequence (cached + its new one)
    hidden: torch.Tensor          # (nb, 1, 1, bs) bool: slots past the end of their sequence
    padded_blocks: torch.Tensor   # (Bd, nb_max) long: each sequence's blocks, padded with its last (dense_decode)
    padded_hidden: torch.Tensor   # (Bd, nb_max * bs) bool: a slot past the end of its sequence, padding included
    _masks: dict = field(default_factory=dict, repr=False)   # the masks a layer makes, once per step

    def score_mask(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """``(nb, H, bs * H_kv)`` bool, True where a query head must not look: a slot past the end of
        its sequence, or a row of another KV head (a block's rows are (slot, KV head) pairs)."""
        key = (num_heads, num_kv_heads)
        if key not in self._masks:
            device, bs = self.hidden.device, self.hidden.shape[-1]
            group = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)          # (H,)
            other_head = group[:, None] != torch.arange(num_kv_heads, device=device)              # (H, H_kv)
            mask = self.hidden.view(-1, 1, bs, 1) | other_head[None, :, None, :]                  # (nb, H, bs, H_kv)
            self._masks[key] = mask.view(-1, num_heads, bs * num_kv_heads)
        return self._masks[key]

    def padded_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """For ``dense_decode``: ``padded_hidden`` as an additive mask, ``(Bd, 1, 1, nb_max * bs)`` in
        ``dtype``: 0 where a slot holds a key, -inf elsewhere. Made once per step, on the device (no host
        data is read inside the forward: on a GPU that would make the host wait)."""
        key = ("bias", dtype)
        if key not in self._masks:
            hidden = self.padded_hidden
            bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
            self._masks[key] = bias[:, None, None, :]
        return self._masks[key]


def decode_blocks(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device) -> DecodeBlocks | None:
    """The ``DecodeBlocks`` of the sequences with one new token, or None when there is none."""
    seqs = [b for b, q in enumerate(query_lens) if q == 1]
    if not seqs:
        return None
    blocks, counts, filled, token_index, padded = [], [], [], [], []
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    for b in seqs:
        n = -(-context_lens[b] // block_size)                     # blocks holding its keys
        blocks += block_tables[b][:n]
        counts.append(n)
        filled += [block_size] * (n - 1) + [context_lens[b] - (n - 1) * block_size]
        token_index.append(starts[b])
    width = max(counts)
    for b, n in zip(seqs, counts):
        padded.append(block_tables[b][:n] + block_tables[b][n - 1:n] * (width - n))
    tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    hidden = torch.arange(block_size, device=device) >= tensor(filled)[:, None]          # (nb, bs)
    lens = [context_lens[b] for b in seqs]
    return DecodeBlocks(seqs, tensor(token_index), tensor(blocks),
                        torch.repeat_interleave(torch.arange(len(seqs), device=device), tensor(counts)),
                        tensor(counts), lens, hidden[:, None, None, :], tensor(padded),
                        torch.arange(width * block_size, device=device) >= tensor(lens)[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBlocks,
                 scale: float) -> torch.Tensor:
    """q ``(Bd, H, D)``, one query per decode sequence; caches ``(num_blocks, bs, H_kv, D)`` -> ``(Bd, H, D)``."""
    bd, h, d = q.shape
    dtype = torch.float32                                          # scores and softmax in fp32, also for bf16
    if bd == 1:
        return _one_sequence(q, k_cache, v_cache, dec, scale, dtype)
    rows = k_cache.shape[1] * k_cache.shape[2]                     # bs * H_kv rows per block
    kb = k_cache.index_select(0, dec.blocks).view(-1, rows, d).to(dtype)   # (nb, bs*H_kv, D): only the blocks used
    vb = v_cache.index_select(0, dec.blocks).view(-1, rows, d).to(dtype)
    qb = q.to(dtype).index_select(0, dec.block_seq)                # (nb, H, D): each block's sequence's query
    s = torch.baddbmm(qb.new_empty(()), qb, kb.transpose(1, 2), beta=0, alpha=scale)  # (nb, H, bs*H_kv)
    hidden = dec.score_mask(h, k_cache.shape[2])
    # reductions over each sequence's blocks (they lie one sequence after another). unsafe: the lengths, built
    # by decode_blocks and each >= 1, go unchecked; the check costs 11 ops and, on a GPU, two host syncs
    per_seq = dict(lengths=dec.num_blocks, unsafe=True)
    m = torch.segment_reduce(s.masked_fill_(hidden, float("-inf")).amax(-1), "max", **per_seq)     # (Bd, H)
    # exp of a score more than 80 below its row's max is under 2e-35, too small to change an fp32 sum
    # that holds the max's weight of 1; clamped there, exp never makes denormals (3x slower here)
    p = (s - m.index_select(0, dec.block_seq).unsqueeze(-1)).clamp_min_(-80.0).exp_().masked_fill_(hidden, 0.0)
    den = torch.segment_reduce(p.sum(-1), "sum", **per_seq)                                      # (Bd, H)
    # index_add_: segment_reduce sums (nb, H, D) 5x slower on CPU; on a GPU index_add_ adds with atomics,
    # in no fixed order, so two runs may differ in the last bit
    o = p.new_zeros(bd, h, d).index_add_(0, dec.block_seq, torch.bmm(p, vb))                     # (Bd, H, D)
    return (o / den.unsqueeze(-1)).to(q.dtype)


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBlocks,
                 scale: float) -> torch.Tensor:
    """``paged_decode`` as a GPU runs it best: the same inputs and result, in a few kernel launches a layer.

    On a GPU a decode step is bound by launching kernels, not by the bytes moved, and ``paged_decode`` takes
    about 30 launches a layer (its segment reductions and casts). Here each sequence's blocks are gathered
    into one padded row, ``(Bd, nb_max * bs, H_kv, D)``, and one SDPA call attends them under a mask that
    hides the padding (``DecodeBlocks.padded_bias``, made once per step). GQA without repeating the KV heads:
    the G query heads of a KV head are viewed as G queries of one sequence (one decode query each, so no
    causal mask applies among them). SDPA computes in the query's dtype with fp32 softmax statistics, as
    HF's attention does. A single sequence needs no mask: its keys are sliced to its length.
    """
    bd, h, d = q.shape
    h_kv = k_cache.shape[2]
    if bd == 1:
        n = dec.context_lens[0]
        k = k_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1)[None]   # (1, H_kv, Lk, D)
        v = v_cache.index_select(0, dec.blocks).flatten(0, 1)[:n].transpose(0, 1)[None]
        bias = None
    else:
        table, bias = dec.padded_blocks.view(-1), dec.padded_bias(q.dtype)
        k = k_cache.index_select(0, table).view(bd, -1, h_kv, d).transpose(1, 2)          # (Bd, H_kv, L, D)
        v = v_cache.index_select(0, table).view(bd, -1, h_kv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(bd, h_kv, h // h_kv, d), k, v, attn_mask=bias, scale=scale)
    return o.reshape(bd, h, d)         # a GPU kernel may return (Bd, G, H_kv, D) in memory: reshape, not view


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
