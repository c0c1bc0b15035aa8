"""A step's ``AttentionMetadata``, built incrementally: each sequence keeps the cache slots of its
blocks between steps, extended when the block manager gives it a new block, so a decode step costs a
few list operations per sequence rather than rebuilding every sequence's slots from its block table.

The result is the same as ``tplab.layers.attention.build_metadata`` on the same sequences
(tests/test_chunked_prefill.py checks it), which stays the from-scratch reference that the
notebooks and ``probe`` use.
"""
import torch

from tplab.layers.attention import AttentionMetadata, build_metadata, causal_visible
from tplab.layers.paged_decode import decode_blocks


class MetadataBuilder:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self._offsets = torch.arange(block_size, device=device)
        self._slots: dict[int, tuple[list[int], torch.Tensor]] = {}   # seq_id -> (its blocks, their slots)
        self._all_true = torch.ones(1, 0, dtype=torch.bool, device=device)  # decode masks are views of it

    def slots_of(self, seq) -> torch.Tensor:
        """``(len(block_table) * block_size,)`` the slots of ``seq``'s blocks, in order."""
        table = seq.block_table
        blocks, slots = self._slots.get(seq.seq_id, ([], None))
        n = len(blocks)
        if n > len(table) or table[:n] != blocks:                     # new blocks after a preemption
            blocks, slots, n = [], None, 0
        if n < len(table):
            new = (torch.tensor(table[n:], device=self.device)[:, None] * self.block_size + self._offsets).flatten()
            slots = new if slots is None else torch.cat([slots, new])
            self._slots[seq.seq_id] = (list(table), slots)
        return slots

    def decode_mask(self, context_len: int) -> torch.Tensor:
        """``(1, Lk)`` all True: the one query of a decode step sees every key (``causal_visible(1, Lk)``)."""
        if self._all_true.shape[1] < context_len:
            self._all_true = torch.ones(1, max(context_len, 2 * self._all_true.shape[1]), dtype=torch.bool,
                                        device=self.device)
        return self._all_true[:, :context_len]

    def build(self, seqs, positions_fn) -> AttentionMetadata:
        """The metadata of a step that feeds each of ``seqs`` its next ``num_scheduled_tokens`` tokens;
        ``positions_fn`` is ``Parts.positions``, checked against the cache as ``build_metadata`` does."""
        q_start, kv_start, seq_lens, kv_parts, new_parts, visible = [0], [0], [], [], [], []
        positions, expected = [], []
        for seq in seqs:
            cached, n = seq.num_cached_tokens, seq.num_new_tokens
            context = cached + n
            slots = self.slots_of(seq)
            kv_parts.append(slots[:context])                          # (Lk,) its keys, cached then new
            new_parts.append(slots[cached:context])                   # (Lq,) where its new K/V go
            visible.append(self.decode_mask(context) if n == 1 else causal_visible(n, context, self.device))
            q_start.append(q_start[-1] + n)
            kv_start.append(kv_start[-1] + context)
            seq_lens.append(context)
            positions += positions_fn(seq)
            expected += range(cached, context)
        if positions != expected:                                     # raises, naming the token
            build_metadata([s.num_new_tokens for s in seqs], seq_lens, [s.block_table for s in seqs],
                           self.block_size, self.device, positions)
        query_lens = [s.num_new_tokens for s in seqs]
        return AttentionMetadata(
            positions=torch.tensor(positions, device=self.device), slot_mapping=torch.cat(new_parts),
            query_start_loc=q_start, seq_lens=seq_lens, kv_slots=torch.cat(kv_parts), kv_start_loc=kv_start,
            visible=visible, decode=decode_blocks(query_lens, seq_lens, [s.block_table for s in seqs],
                                                  self.block_size, self.device))

    def forget(self, seq_id: int) -> None:
        self._slots.pop(seq_id, None)

    def clear(self) -> None:
        self._slots.clear()
