"""Which KV blocks the decode sequences of a step hold, as tensors: what an ``attend`` that attends every decode
token of a step at once (``tplab.layers.attend_method.AttendsDecodesTogether``, tplab's ``sdpa_attend``) reads from
``meta.decode``, made by its ``decode_inputs`` once per step from the host's block tables, before the forward
(``ModelRunner.prepare``); a decode step at fixed shapes has a ``PaddedDecode`` there instead.

Shapes: Bd decode sequences, nb blocks they hold in all, bs block_size.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeBlocks:
    """Which KV blocks the decode sequences (query length 1) of a step hold. Built once per step, before the
    forward: the padded fields too, though only a GPU's ``dense_decode`` reads them, since a tensor made from
    host data inside the forward would make a GPU's host wait for the kernels queued before it."""
    seqs: list[int]               # Bd ints: index b of each decode sequence in the step
    token_index: torch.Tensor     # (Bd,) long: its token's row in the step's T tokens
    blocks: torch.Tensor          # (nb,) long: each decode sequence's blocks in order, one sequence after another
    block_seq: torch.Tensor       # (nb,) long: which decode sequence (0 .. Bd-1) each block belongs to
    num_blocks: torch.Tensor      # (Bd,) long: blocks per decode sequence
    context_lens: list[int]       # Bd ints: keys of each decode sequence (cached + its new one)
    past_end: torch.Tensor        # (nb, bs) bool: slots past the end of their sequence
    padded_blocks: torch.Tensor   # (Bd, nb_max) long: each sequence's blocks, padded with its last (a GPU's decode)
    padded_past_end: torch.Tensor  # (Bd, nb_max * bs) bool: a slot past the end of its sequence, padding included
    per_step: dict = field(default_factory=dict, repr=False)  # what an attend makes of these once a step


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
    past_end = torch.arange(block_size, device=device) >= tensor(filled)[:, None]        # (nb, bs)
    lens = [context_lens[b] for b in seqs]
    return DecodeBlocks(seqs, tensor(token_index), tensor(blocks),
                        tensor([i for i, n in enumerate(counts) for _ in range(n)]),
                        tensor(counts), lens, past_end, tensor(padded),
                        torch.arange(width * block_size, device=device) >= tensor(lens)[:, None])


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step at fixed shapes, for ``padded_decode`` (``SdpaAttend.attend_step`` hands it over): row b's
    keys are the first ``context_lens[b]`` slots of its blocks ``block_tables[b]``; every row is one decode query."""
    block_tables: torch.Tensor    # (Bp, W) long: each row's blocks, padded to W with blocks it does not read
    context_lens: torch.Tensor    # (Bp,) long: each row's keys (cached + its new one), at least 1
    block_size: int               # slots per block
    per_step: dict = field(default_factory=dict, repr=False, compare=False)  # what an attend makes once a step

    @property
    def seqs(self) -> range:
        return range(self.block_tables.shape[0])      # every row of the step is a decode

    @property
    def padded_past_end(self) -> torch.Tensor:
        """``(Bp, W * bs)`` bool: a slot past the end of its row's keys. Computed on the device from the lengths'
        tensor when read: inside a CUDA graph its kernels are recorded, and every replay computes it anew."""
        keys = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.context_lens.device)
        return keys >= self.context_lens[:, None]
