"""One rank's model runner: its paged KV cache, and one forward pass per step that feeds every
scheduled sequence its next tokens (a decode token, or a chunk of a prompt) and samples one token for
each sequence that has no uncached token left.

The KV cache holds, per layer, K and V in the layout the attention part declares (``kv_cache_shape``;
tplab's own is ``(num_blocks, block_size, H_kv, D)``, and one scratch block more under ``static_decode``):
this rank's KV heads only (``H_kv = num_kv_heads / tp_size``, or one replica when they are fewer than the
ranks), never their repeats for the query heads. GQA repeats K/V only inside the score computation, so the
cache is ``H / H_kv`` times smaller than a cache of query heads.
"""
import math
from dataclasses import dataclass

import torch

from tplab.engine.sampling import sample
from tplab.engine.sequence import Sequence
from tplab.layers.attend_method import AttendsDecodesTogether
from tplab.layers.metadata import MetadataBuilder


def token_positions(seq: Sequence) -> list[int]:
    """Positions of the tokens a step feeds for ``seq``: their index in the sequence."""
    return list(range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_new_tokens))


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's paged KV cache, worked out from the model config (not the built model)."""
    num_layers: int
    block_size: int                  # tokens per block
    block_shape: tuple[int, ...]     # one block of K (or V) in one layer, e.g. (block_size, H_kv, D)
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * math.prod(self.block_shape) * itemsize

    def allocate(self, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V per layer, ``(num_blocks, *block_shape)``, allocated once and written in place."""
        shape = (num_blocks, *self.block_shape)
        return [(torch.zeros(shape, dtype=self.dtype, device=device),
                 torch.zeros(shape, dtype=self.dtype, device=device)) for _ in range(self.num_layers)]


def spread(caches: list, layers) -> list:
    """The caches of ``layers`` (global layer indices) at their places in a list indexed by global layer index:
    None for an earlier pipeline stage's layers; the list ends at this stage's last."""
    placed = [None] * (max(layers, default=-1) + 1)
    for i, kv in zip(layers, caches):
        placed[i] = kv
    return placed


class ModelRunner:
    """Owns the model shard and its KV cache on one rank; ``step`` runs prefill chunks and decodes alike.

    ``kv_layers`` (default: every layer) are the layers this rank keeps a cache for (a pipeline stage's own), and
    ``num_virtual_engines`` the batches in flight under pipeline parallelism, each with its own ``num_blocks`` blocks
    (``kv_caches_of[v]``); ``kv_caches[i]`` is layer i's cache of the first, the only one without PP."""

    def __init__(self, model, spec: KVCacheSpec, num_blocks: int, device: torch.device, positions_of=token_positions,
                 kv_layers=None, num_virtual_engines: int = 1, make_static_decode=None, attend=None):
        self.model, self.device = model, torch.device(device)
        self.attend = attend                        # Parts.attend: one that attends a step's decodes together
                                                    # is handed their blocks, made here before the forward
        self.positions_of = positions_of            # Parts.positions: only checked (a wrong one raises); RoPE
                                                    # takes the positions the cache lengths give
        self.num_blocks = num_blocks                # the block manager's; a static decode adds a scratch block
        kv_layers = range(spec.num_layers) if kv_layers is None else kv_layers
        allocated = num_blocks + (make_static_decode is not None)
        self.kv_caches_of = [spread(spec.allocate(allocated, self.device), kv_layers)
                             for _ in range(num_virtual_engines)]
        self.kv_caches = self.kv_caches_of[0]
        self.metadata = MetadataBuilder(spec.block_size, self.device)
        # make_static_decode(model, kv_caches, scratch_block, positions_of): the decode steps at fixed shapes
        self.static = (None if make_static_decode is None
                       else make_static_decode(model, self.kv_caches, num_blocks, positions_of))

    def kv_cache_bytes(self) -> int:
        """Bytes of every layer's ``(k, v)`` caches, over the batches in flight."""
        return sum(t.numel() * t.element_size() for caches in self.kv_caches_of for kv in caches if kv is not None
                   for t in kv)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[tuple[int, float] | None]:
        """Run the scheduled batch: feed each sequence its ``num_new_tokens`` next tokens, and sample one
        token for each whose tokens are then all cached. Returns ``[(token, logprob)]``, None for a prompt
        chunk that is not the last. Changes no sequence: ``Scheduler.postprocess`` records the step."""
        if self.static is not None and self.static.fits(seqs):       # one new token each: fixed shapes
            return self.sample(seqs, list(range(len(seqs))), self.static.forward(seqs))               # (B, E)
        input_ids, meta = self.prepare(seqs)
        hidden = self.model(input_ids, self.kv_caches, meta)                                          # (T, E)
        return self.sample(seqs, meta.last_token_rows(), hidden)

    def prepare(self, seqs: list[Sequence]):
        """A step's token ids ``(T,)`` and its attention metadata."""
        query_lens = [s.num_new_tokens for s in seqs]
        context_lens = [s.num_cached_tokens + s.num_new_tokens for s in seqs]
        tables = [s.block_table for s in seqs]
        meta = self.metadata.build(query_lens, context_lens, tables, [p for s in seqs for p in self.positions_of(s)],
                                   [s.seq_id for s in seqs])
        if isinstance(self.attend, AttendsDecodesTogether):             # tplab's own: the decodes' blocks
            meta.decode = self.attend.decode_inputs(query_lens, context_lens, tables, self.metadata.block_size,
                                                    self.device)
        input_ids = torch.tensor([t for s in seqs for t in s.new_token_ids()], device=self.device)   # (T,)
        return input_ids, meta

    def sample(self, seqs: list[Sequence], last_rows: list[int], hidden: torch.Tensor) -> list[tuple[int, float] | None]:
        """From the final hidden states ``(T, E)``, sequence b's last token in row ``last_rows[b]``:
        ``(token, logprob)`` for each sequence whose tokens are then all cached, None for the others."""
        to_sample = [b for b, seq in enumerate(seqs) if seq.num_cached_tokens + seq.num_new_tokens == len(seq)]
        out: list[tuple[int, float] | None] = [None] * len(seqs)
        if not to_sample:
            return out
        rows = [last_rows[b] for b in to_sample]
        if rows != list(range(hidden.shape[0])):      # else every row is sampled (a decode step): no index to send
            hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))                    # (S, E)
        logits = self.model.compute_logits(hidden)                                                     # (S, V)
        tokens, logprobs = sample(logits, [seqs[b].params for b in to_sample], [seqs[b].generator for b in to_sample])
        for b, token, logprob in zip(to_sample, tokens.tolist(), logprobs.tolist()):
            out[b] = (token, logprob)
        return out

    def forget(self, finished: list[Sequence]) -> None:
        """Drop the cache slots the metadata builder keeps for these finished sequences."""
        for seq in finished:
            self.metadata.forget(seq.seq_id)
