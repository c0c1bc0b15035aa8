# Exercise: block_manager (reference solution)
from tplab.exercises.block_manager_base import BlockManagerBase


class MyBlockManager(BlockManagerBase):
    """allocate, may_append and free on top of the given free list, reference counts and chained hashes."""

    def allocate(self, seq, num_cached_blocks=0):
        cached = [self.hash_to_block_id[h] for h in self.hash_full_blocks(seq)[:num_cached_blocks]]
        for block in cached:                                 # share them: one more user each
            if self.ref_counts[block] == 0:
                self.free_block_ids.remove(block)            # it was free, with its tokens still in it
            self.ref_counts[block] += 1
        seq.block_table = cached + [self.take_free_block()
                                    for _ in range(self.blocks_needed(len(seq)) - len(cached))]
        seq.num_cached_tokens = len(cached) * self.block_size
        self.prefix_cache_hit_blocks += len(cached)
        if self.enable_prefix_caching:                       # the full blocks computed now can be shared later
            for i in range(len(cached), len(seq) // self.block_size):
                self.register(seq.block_table[i], seq, i)

    def may_append(self, seq):
        if len(seq.block_table) < self.blocks_needed(len(seq)):     # the newest token starts a block
            seq.block_table.append(self.take_free_block())
        if self.enable_prefix_caching and len(seq) % self.block_size == 0:   # ...or fills one
            i = len(seq) // self.block_size - 1
            self.register(seq.block_table[i], seq, i)

    def free(self, seq):
        for block in reversed(seq.block_table):              # the tail first: the least likely to be shared
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_block_ids.append(block)            # keeps its hash: a later prompt may still hit it
        seq.block_table, seq.num_cached_tokens = [], 0
