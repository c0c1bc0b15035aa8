"""One rank's model runner: its paged KV cache, and one forward pass per step that feeds every
scheduled sequence its new tokens and samples one token for each.

The KV cache holds, per layer, K and V of shape ``(num_blocks, block_size, H_kv, D)``: this rank's
KV heads only (``H_kv = num_kv_heads / tp_size``, or one replica when they are fewer than the
ranks), never their repeats for the query heads. GQA repeats K/V only inside the score
computation, so the cache is ``H / H_kv`` times smaller than a cache of query heads.
"""
import math
from dataclasses import dataclass

import torch

from tplab.engine.sampling import sample
from tplab.engine.sequence import Sequence
from tplab.layers.attention import build_metadata


def token_positions(seq: Sequence) -> list[int]:
    """Positions of the tokens a step feeds for ``seq``: their index in the sequence."""
    return list(range(seq.num_cached_tokens, len(seq)))


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


def kv_cache_bytes(kv_caches) -> int:
    """Bytes held by a list of per-layer ``(k, v)`` caches."""
    return sum(t.numel() * t.element_size() for kv in kv_caches for t in kv)


class ModelRunner:
    """Owns the model shard and its KV cache on one rank; ``step`` runs prefill and decode alike."""

    def __init__(self, model, spec: KVCacheSpec, num_blocks: int, device: torch.device, positions=token_positions):
        self.model, self.spec, self.device = model, spec, torch.device(device)
        self.positions = positions                  # Parts.positions: a step's token positions
        self.num_blocks = num_blocks
        self.kv_caches = spec.allocate(num_blocks, self.device)

    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.kv_caches)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[tuple[int, float]]:
        """Feed each sequence's uncached tokens, sample one token per sequence: ``[(token, logprob)]``."""
        new_tokens = [seq.new_token_ids() for seq in seqs]
        query_lens = [len(t) for t in new_tokens]
        meta = build_metadata(query_lens, [len(s) for s in seqs], [s.block_table for s in seqs],
                              self.spec.block_size, self.device,
                              positions=[p for s in seqs for p in self.positions(s)])
        input_ids = torch.tensor([t for ts in new_tokens for t in ts], device=self.device)   # (T,)
        hidden = self.model(input_ids, self.kv_caches, meta)                                  # (T, E)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1                     # (B,)
        logits = self.model.compute_logits(hidden.index_select(0, last))                      # (B, V)
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
        return list(zip(tokens.tolist(), logprobs.tolist()))
