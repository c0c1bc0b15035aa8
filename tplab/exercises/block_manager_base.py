"""What notebook 05's block manager exercise gives: ``BlockManagerBase``, a paged KV block manager with
everything but the three methods that move blocks (``allocate``, ``may_append``, ``free``), which the
learner's ``MyBlockManager(BlockManagerBase)`` writes. The engine's own is ``tplab.engine.block_manager``."""
from collections import deque

from tplab.engine.block_manager import chain_hash     # a full block's key: the engine's, so the two caches agree


class BlockManagerBase:
    """Paged KV blocks: a free list, a reference count per block, and prefix caching by chained hashes."""

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.ref_counts = [0] * num_blocks                  # sequences using each block
        self.block_hash = [None] * num_blocks               # the hash of a full block's tokens, once registered
        self.block_tokens = [()] * num_blocks               # ...and its tokens, to rule out a hash collision
        self.free_block_ids = deque(range(num_blocks))      # take from the front, give back at the end
        self.hash_to_block_id = {}
        self.prefix_cache_hit_blocks = self.peak_blocks_used = 0

    @property
    def num_blocks(self):
        return len(self.ref_counts)

    @property
    def num_used_blocks(self):
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def tokens_of_block(self, seq, i):
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def hash_full_blocks(self, seq):
        """seq.block_hashes, extended to every full block of seq; each chains on the one before."""
        for i in range(len(seq.block_hashes), len(seq) // self.block_size):
            seq.block_hashes.append(chain_hash(seq.block_hashes[-1] if i else None, self.tokens_of_block(seq, i)))
        return seq.block_hashes

    def can_allocate(self, seq):
        """How many leading full blocks of seq are cached (never the one with its last token), or None."""
        hits = []
        if self.enable_prefix_caching:
            for i, h in enumerate(self.hash_full_blocks(seq)[:(len(seq) - 1) // self.block_size]):
                block = self.hash_to_block_id.get(h)
                if block is None or self.block_tokens[block] != self.tokens_of_block(seq, i):
                    break
                hits.append(block)
        revived = sum(self.ref_counts[b] == 0 for b in hits)     # cached blocks still on the free list
        enough = len(self.free_block_ids) >= self.blocks_needed(len(seq)) - len(hits) + revived
        return len(hits) if enough else None

    def can_append(self, seq):
        return len(self.free_block_ids) >= int(len(seq.block_table) < self.blocks_needed(len(seq)))

    def take_free_block(self):
        """The first free block, with one user (the caller), its stale hash forgotten: it is about to be overwritten."""
        block = self.free_block_ids.popleft()
        if self.block_hash[block] is not None and self.hash_to_block_id.get(self.block_hash[block]) == block:
            del self.hash_to_block_id[self.block_hash[block]]
        self.ref_counts[block], self.block_hash[block], self.block_tokens[block] = 1, None, ()
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_used_blocks)
        return block

    def register(self, block, seq, i):
        """Prefix caching: full block i of seq, held in ``block``, can be found by its hash from now on."""
        h = self.hash_full_blocks(seq)[i]
        self.block_hash[block], self.block_tokens[block] = h, self.tokens_of_block(seq, i)
        self.hash_to_block_id[h] = block

    def allocate(self, seq, num_cached_blocks=0):
        raise NotImplementedError("write allocate in MyBlockManager")

    def may_append(self, seq):
        raise NotImplementedError("write may_append in MyBlockManager")

    def free(self, seq):
        raise NotImplementedError("write free in MyBlockManager")
