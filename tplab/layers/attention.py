"""Causal self-attention over a KV cache addressed by slots, shared by prefill and decode.

A step packs the new tokens of B sequences into one flat batch of T tokens. The
KV cache of a layer is ``(num_blocks, block_size, H_kv, D)`` for K and for V; a
token at position p of a sequence lives in slot ``block_table[p // block_size] *
block_size + p % block_size``. A contiguous cache is the special case of one block
per sequence that is as long as the longest sequence.

Shape legend: T new tokens in the step, B sequences, Lq the longest query (new
tokens of one sequence), Lk the longest context (cached + new), H query heads and
H_kv KV heads on this rank, D head_dim.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each query may see. Built once per step."""
    positions: torch.Tensor     # (T,)  position of each new token in its sequence
    slot_mapping: torch.Tensor  # (T,)  cache slot each new token's K/V is written to
    q_index: torch.Tensor       # (B, Lq) index into the T tokens of query i of sequence b (padded with 0)
    q_packed: torch.Tensor      # (T,)  row of each new token in the flattened (B * Lq) query grid
    kv_slots: torch.Tensor      # (B, Lk) cache slot of key position j of sequence b (padded with a real slot)
    visible: torch.Tensor       # (B, 1, Lq, Lk) bool: True where query i may attend to key j


def causal_visible(query_lens: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """``(B, 1, Lq, Lk)`` booleans: query i of sequence b sees keys ``j <= context - query_len + i``.

    Booleans, applied with ``masked_fill``/``where`` (or SDPA's bool mask), never
    ``ones * -inf``: IEEE says ``0 * -inf = NaN``, and one NaN in a score row
    turns the whole softmax row into NaN.
    """
    i = torch.arange(int(query_lens.max()))[None, :, None]          # (1, Lq, 1)
    j = torch.arange(int(context_lens.max()))[None, None, :]        # (1, 1, Lk)
    first = (context_lens - query_lens)[:, None, None]              # (B, 1, 1) cached tokens before the query
    return ((j <= first + i) & (j < context_lens[:, None, None])).unsqueeze(1)


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device, positions: list[int] | None = None) -> AttentionMetadata:
    """Metadata for B sequences whose last ``query_lens[b]`` of ``context_lens[b]`` tokens are new.

    ``positions`` (packed, one per new token), when the caller tracks them itself, are
    checked against the cache: a new token's position must equal the number of
    tokens before it, or RoPE and the cache slots would disagree silently.
    """
    ql = torch.tensor(query_lens)
    cl = torch.tensor(context_lens)
    if bool((ql < 1).any() or (ql > cl).any()):
        raise ValueError(f"each sequence needs 1 <= query_len <= context_len, got {query_lens} / {context_lens}")
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [t[-1]] * (width - len(t)) for t in block_tables])  # (B, max_blocks)

    def slots(pos: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return tables[seq, pos // block_size] * block_size + pos % block_size

    seq_of_token = torch.repeat_interleave(torch.arange(len(ql)), ql)                  # (T,)
    starts = torch.cumsum(ql, 0) - ql                                                  # first token of each seq
    expected = torch.arange(int(ql.sum())) - starts[seq_of_token] + (cl - ql)[seq_of_token]
    if positions is None:
        positions = expected
    else:
        positions = torch.as_tensor(positions)
        if not torch.equal(positions, expected):
            t = int((positions != expected).nonzero()[0])
            raise ValueError(f"token {t} of the step (sequence {int(seq_of_token[t])}) has position "
                             f"{int(positions[t])} but {int(expected[t])} tokens are cached before it: "
                             "positions must count the tokens already in the KV cache")
    i = torch.arange(int(ql.max()))
    q_index = (starts[:, None] + i).clamp(max=int(ql.sum()) - 1)
    j = torch.minimum(torch.arange(int(cl.max()))[None, :], cl[:, None] - 1)          # clamp padding to a real key
    kv_slots = slots(j, torch.arange(len(ql))[:, None])
    to = lambda t: t.to(device, non_blocking=True)
    return AttentionMetadata(
        positions=to(positions), slot_mapping=to(slots(positions, seq_of_token)),
        q_index=to(q_index), q_packed=to((i[None, :] < ql[:, None]).flatten().nonzero().flatten()),
        kv_slots=to(kv_slots), visible=to(causal_visible(ql, cl)))


def sdpa_attend(q, k, v, visible, scale):
    """softmax(q k^T * scale, masked by ``visible``) v, with GQA grouping inside SDPA.

    q ``(B, H, Lq, D)``, k/v ``(B, H_kv, Lk, D)``: the KV heads are never copied to H.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)


class Attention(nn.Module):
    """Writes this step's K/V into the cache, then attends from the new queries to the cached keys."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, attend=sdpa_attend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.attend = attend

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
        # index_select, not advanced indexing: the same gather, without its per-call overhead
        b, lk = meta.kv_slots.shape
        keys = k_cache.index_select(0, meta.kv_slots.flatten()).view(b, lk, *k.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, meta.kv_slots.flatten()).view(b, lk, *v.shape[1:]).transpose(1, 2)
        queries = q.index_select(0, meta.q_index.flatten()).view(*meta.q_index.shape, *q.shape[1:])
        out = self.attend(queries.transpose(1, 2), keys, values, meta.visible, self.scale)  # (B, H, Lq, D)
        out = out.transpose(1, 2).flatten(0, 1).index_select(0, meta.q_packed)  # (T, H, D), packed order
        return out.flatten(1)                                       # (T, H * D)
