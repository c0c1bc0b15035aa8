"""One rank's model runner: turns a list of sequences into one forward pass and a sampled token each."""
import torch

from tplab.cache.kv_cache import allocate_kv_cache, kv_cache_bytes
from tplab.engine.sampling import sample
from tplab.engine.sequence import Sequence
from tplab.layers.attention import build_metadata


def token_positions(seq: Sequence) -> list[int]:
    """Positions of the tokens a step feeds for ``seq``: their index in the sequence."""
    return list(range(seq.num_cached_tokens, len(seq)))


class ModelRunner:
    """Owns the model shard and its KV cache on one rank; ``step`` runs prefill and decode alike."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, positions_fn=token_positions):
        self.model, self.device, self.dtype = model, device, dtype
        self.positions_fn = positions_fn
        attn = model.model.layers[0].self_attn
        # Heads per token the cache holds: the KV heads (never their repeats for the query heads).
        self.cache_heads, self.head_dim = attn.attn.cache_heads, attn.head_dim
        self.kv_caches, self.block_size = [], 0

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of ``block_size`` tokens in every layer, for this rank's KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.model.model.layers) * block_size * self.cache_heads * self.head_dim * itemsize

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged cache: per layer, K and V of ``(num_blocks, block_size, H_kv, D)``."""
        self.kv_caches = []  # free an old cache before allocating the new one
        self.kv_caches = allocate_kv_cache(len(self.model.model.layers), num_blocks, block_size,
                                           self.cache_heads, self.head_dim, self.dtype, self.device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.kv_caches)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[tuple[int, float]]:
        """Feed each sequence's uncached tokens, sample one token per sequence: ``[(token, logprob)]``."""
        new_tokens = [seq.new_token_ids() for seq in seqs]
        query_lens = [len(t) for t in new_tokens]
        meta = build_metadata(query_lens, [len(s) for s in seqs], [s.block_table for s in seqs],
                              self.block_size, self.device,
                              positions=[p for s in seqs for p in self.positions_fn(s)])
        input_ids = torch.tensor([t for ts in new_tokens for t in ts], device=self.device)   # (T,)
        hidden = self.model(input_ids, self.kv_caches, meta)                                  # (T, E)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1                     # (B,)
        logits = self.model.compute_logits(hidden.index_select(0, last))                                     # (B, V)
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
        return list(zip(tokens.tolist(), logprobs.tolist()))
