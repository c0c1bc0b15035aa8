"""A step's ``AttentionMetadata``: where each new token's K/V go in the paged cache, and which keys each
sequence reads. One builder makes it for the engine (``ModelRunner``, once per step), for ``probe`` and
for the notebooks (``build_metadata``); a decode step at fixed shapes makes its own from fixed buffers
(``tplab.engine.static_decode``).

The engine's builder keeps each sequence's cache slots between steps, extended when the block manager
gives it a new block, so a decode step appends to a sequence's slots rather than rebuilding them from its
block table; ``build_metadata`` builds them from the tables each time.

Shape legend: T new tokens in the step, B sequences, Lq new tokens of one sequence, Lk its keys
(cached + new), N the keys of all B sequences.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where a step's new tokens go in the cache, and which keys each sequence reads. Built once
    per step (``MetadataBuilder.build``) and read by every layer.

    Sequence b owns new tokens ``query_start_loc[b]:query_start_loc[b + 1]`` of the T packed
    tokens, and its keys are ``kv_slots[kv_start_loc[b]:kv_start_loc[b + 1]]``: the cache slots of
    its positions ``0 .. seq_lens[b] - 1``, in order (its cached tokens, then this step's). A decode step at
    fixed shapes (``tplab.engine.static_decode``) sets only ``positions``, ``slot_mapping``,
    ``query_start_loc`` and ``decode``; its per-sequence fields are None.
    """
    positions: torch.Tensor       # (T,) long: position of each new token in its sequence (RoPE's angle)
    slot_mapping: torch.Tensor    # (T,) long: cache slot each new token's K/V is written to
    query_start_loc: list[int]    # B + 1 ints: where each sequence's new tokens start; the last is T
    seq_lens: list[int]           # B ints: each sequence's length after this step (its Lk)
    kv_slots: torch.Tensor        # (N,) long: every sequence's key slots, packed; N = sum(seq_lens)
    kv_start_loc: list[int]       # B + 1 ints: where each sequence's keys start in kv_slots; the last is N
    visible: list[torch.Tensor]   # B bool masks (Lq, Lk): causal_visible(Lq, Lk), True = may attend
    decode: object = None         # for a kernel: the blocks the decode sequences hold (tplab.kernels.decode_blocks)
    block_tables: list[list[int]] = field(default_factory=list)  # B lists: each sequence's blocks, in order
    per_step: dict = field(default_factory=dict, repr=False)  # what a part makes once a step for every layer

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        """New tokens of each sequence (its Lq)."""
        return [b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])]

    def last_token_rows(self) -> list[int]:
        """The row of each sequence's last new token among the step's T: its next token is sampled from there."""
        return [end - 1 for end in self.query_start_loc[1:]]

    def seq_kv_slots(self, b: int) -> torch.Tensor:
        """``(Lk,)`` the cache slots of sequence b's keys, position 0 first."""
        return self.kv_slots[self.kv_start_loc[b]:self.kv_start_loc[b + 1]]


def causal_visible(query_len: int, context_len: int, device=None) -> torch.Tensor:
    """``(Lq, Lk)`` booleans: the ``Lq`` queries are the last of ``Lk`` positions, so query i sits at
    position ``Lk - Lq + i`` and sees keys ``j <= Lk - Lq + i`` (a decode step, ``Lq = 1``, sees all).

    Booleans, applied with ``masked_fill``/``where`` (or SDPA's bool mask), never ``ones * -inf``:
    IEEE says ``0 * -inf = NaN``, and one NaN in a score row turns the whole softmax row into NaN.
    Every row has a True (its own position), so no row is all ``-inf`` either.
    """
    i = torch.arange(query_len, device=device)[:, None]             # (Lq, 1)
    j = torch.arange(context_len, device=device)[None, :]           # (1, Lk)
    return j <= (context_len - query_len) + i


def _check_lengths(query_lens, context_lens, block_tables, block_size) -> None:
    if not query_lens or not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(f"need one query_len, one context_len and one block table per sequence, got "
                         f"{query_lens} / {context_lens} / {block_tables}")
    if any(not 1 <= q <= c for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"each sequence needs 1 <= query_len <= context_len, got {query_lens} / {context_lens}")
    for b, (c, table) in enumerate(zip(context_lens, block_tables)):
        if len(table) * block_size < c:
            raise ValueError(f"sequence {b} has {c} tokens but {len(table)} blocks of {block_size} slots")


def check_positions(positions: list[int], query_lens, context_lens) -> None:
    """A new token's position must equal the number of tokens before it, or RoPE and the cache slots
    would disagree silently."""
    if len(positions) != sum(query_lens):
        raise ValueError(f"{len(positions)} positions for a step of {sum(query_lens)} new tokens: give one "
                         "position per new token")
    t = 0
    for b, (q, c) in enumerate(zip(query_lens, context_lens)):
        for expected in range(c - q, c):
            if positions[t] != expected:
                raise ValueError(f"token {t} of the step (sequence {b}) has position {positions[t]} but "
                                 f"{expected} tokens are cached before it: positions must count the tokens "
                                 "already in the KV cache")
            t += 1


class MetadataBuilder:
    """Builds each step's ``AttentionMetadata``; keeps the cache slots of the sequences it is given ids of."""

    def __init__(self, block_size: int, device):
        self.block_size, self.device = block_size, torch.device(device)
        self._offsets = torch.arange(block_size, device=self.device)
        self._slots: dict[int, tuple[list[int], torch.Tensor]] = {}   # seq_id -> (its blocks, their slots)
        self._all_true = torch.ones(1, 0, dtype=torch.bool, device=self.device)  # decode masks are views of it

    def _table_slots(self, blocks: list[int]) -> torch.Tensor:
        """``(len(blocks) * block_size,)`` the slots of ``blocks``, in order."""
        return (torch.tensor(blocks, dtype=torch.long, device=self.device)[:, None] * self.block_size
                + self._offsets).flatten()

    def slots_of(self, seq_id: int | None, table: list[int]) -> torch.Tensor:
        """The slots of a sequence's ``table``; those of ``seq_id`` are kept, and extended by its new blocks."""
        if seq_id is None:
            return self._table_slots(table)
        blocks, slots = self._slots.get(seq_id, ([], None))
        n = len(blocks)
        if n > len(table) or table[:n] != blocks:                     # new blocks after a preemption
            blocks, slots, n = [], None, 0
        if n < len(table):
            new = self._table_slots(table[n:])
            slots = new if slots is None else torch.cat([slots, new])
            self._slots[seq_id] = (list(table), slots)
        return slots

    def decode_mask(self, context_len: int) -> torch.Tensor:
        """``(1, Lk)`` all True: the one query of a decode step sees every key (``causal_visible(1, Lk)``)."""
        if self._all_true.shape[1] < context_len:
            self._all_true = torch.ones(1, max(context_len, 2 * self._all_true.shape[1]), dtype=torch.bool,
                                        device=self.device)
        return self._all_true[:, :context_len]

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              positions: list[int] | None = None, seq_ids: list[int] | None = None) -> AttentionMetadata:
        """Metadata for B sequences whose last ``query_lens[b]`` of ``context_lens[b]`` tokens are new this
        step, their K/V in the blocks ``block_tables[b]``. ``positions`` (packed, one per new token), when
        the caller tracks them itself, are checked against the cache. ``seq_ids`` name the sequences
        whose slots this builder keeps for their next step."""
        _check_lengths(query_lens, context_lens, block_tables, block_size=self.block_size)
        expected = [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)]
        if positions is not None and [int(p) for p in positions] != expected:
            check_positions([int(p) for p in positions], query_lens, context_lens)   # raises, naming the token
        q_start, kv_start, kv_parts, new_parts, visible = [0], [0], [], [], []
        for b, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            slots = self.slots_of(None if seq_ids is None else seq_ids[b], table)
            kv_parts.append(slots[:c])                                # (Lk,) its keys, cached then new
            new_parts.append(slots[c - q:c])                          # (Lq,) where its new K/V go
            visible.append(self.decode_mask(c) if q == 1 else causal_visible(q, c, self.device))
            q_start.append(q_start[-1] + q)
            kv_start.append(kv_start[-1] + c)
        return AttentionMetadata(
            positions=torch.tensor(expected, dtype=torch.long, device=self.device),
            slot_mapping=torch.cat(new_parts), query_start_loc=q_start, seq_lens=list(context_lens),
            kv_slots=torch.cat(kv_parts), kv_start_loc=kv_start, visible=visible, block_tables=block_tables)

    def forget(self, seq_id: int) -> None:
        self._slots.pop(seq_id, None)

    def clear(self) -> None:
        self._slots.clear()


def build_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device, positions: list[int] | None = None) -> AttentionMetadata:
    """``MetadataBuilder.build`` from scratch: the metadata of one step, its slots from the block tables."""
    return MetadataBuilder(block_size, device).build(query_lens, context_lens, block_tables, positions)
