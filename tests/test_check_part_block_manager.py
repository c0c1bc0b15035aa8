"""check_part("block_manager", ...): a learner's block manager driven by the real scheduler, and its usual mistakes."""
import sys

import cloudpickle
import pytest

from tplab.exercises import check_part
from tplab.exercises import block_manager_probe, nb05
from tplab.exercises.block_manager_base import BlockManagerBase
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MyBlockManager = define("block_manager")["MyBlockManager"]


def test_a_block_manager_from_scratch_keeps_hf_tokens_through_preemption_and_prefix_hits():
    assert MyBlockManager.__mro__[1:] == (BlockManagerBase, object)    # the exercise's given base, not tplab's engine's
    result = check_part("block_manager", MyBlockManager)
    assert result.ok is True and "preemption(s)" in result.message, result.message


class FreesInOrder(MyBlockManager):
    """Another correct free order: the blocks get reused in another order, nothing else changes."""
    def free(self, seq):
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_block_ids.append(block)
        seq.block_table, seq.num_cached_tokens = [], 0


def test_another_free_order_is_still_right():
    assert block_manager_probe.diagnose(block_manager_probe.run(FreesInOrder)) == (True, "")


class NeverFrees(MyBlockManager):
    def free(self, seq):
        seq.block_table, seq.num_cached_tokens = [], 0


class FreesOnlyTheLastUser(MyBlockManager):
    """Releases a block when its last user frees it, but takes no user off otherwise: a shared prefix leaks."""
    def free(self, seq):
        for block in reversed(seq.block_table):
            if self.ref_counts[block] == 1:
                self.ref_counts[block] = 0
                self.free_block_ids.append(block)
        seq.block_table, seq.num_cached_tokens = [], 0


class RaisesInMayAppend(MyBlockManager):
    def may_append(self, seq):
        seq.block_table[len(seq) // self.block_size + 5]          # a wrong index: the learner's line is named
        super().may_append(seq)


class IgnoresTheCache(MyBlockManager):
    def allocate(self, seq, num_cached_blocks=0):
        super().allocate(seq, 0)


class NeverRegistersOnAppend(MyBlockManager):
    def may_append(self, seq):
        if len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self.take_free_block())


class Stub(BlockManagerBase):
    """The notebook's stub: the given base, the three methods still to write."""
    def allocate(self, seq, num_cached_blocks=0):
        raise NotImplementedError

    def may_append(self, seq):
        raise NotImplementedError

    def free(self, seq):
        raise NotImplementedError


def test_the_stub_on_the_given_base_is_not_attempted():
    assert check_part("block_manager", Stub).ok is None


@pytest.mark.parametrize("impl, words", [
    (NeverFrees, "after free(A), block(s) [2, 6] are held by no sequence, but their ref_counts are [1, 1] and they are "
                 "off the free list: every free takes one user off each of its blocks"),
    (FreesOnlyTheLastUser, "after free(E) at the end, block(s) [1] are held by no sequence, but their ref_counts "
                           "are [4]"),
    (RaisesInMayAppend, "may_append(A) at 11 tokens raised IndexError: list index out of range in your may_append, "
                        "line"),
    (IgnoresTheCache, "after allocate(B): the same 8-token prefix + 1: cached is"),
    (NeverRegistersOnAppend, "fits is 2, expected 3. A's third block filled up in may_append"),
    (NeverRegistersOnAppend, "register it in the cache")])
def test_block_manager_mistakes_are_named(impl, words):
    result = check_part("block_manager", impl)
    assert result.ok is False and words in result.message, result.message


class FreesShared(MyBlockManager):
    """Gives every block back, even the prefix blocks B still shares."""
    def free(self, seq):
        for block in seq.block_table:
            self.ref_counts[block] = 0
            self.free_block_ids.append(block)
        seq.block_table, seq.num_cached_tokens = [], 0


class NoUserOnHit(MyBlockManager):
    """Shares cached blocks without counting the new user."""
    def allocate(self, seq, num_cached_blocks=0):
        super().allocate(seq, num_cached_blocks)
        for block in seq.block_table[:num_cached_blocks]:
            self.ref_counts[block] -= 1


class HitLeftOnFreeList(MyBlockManager):
    def allocate(self, seq, num_cached_blocks=0):
        revived = [self.hash_to_block_id[h] for h in self.hash_full_blocks(seq)[:num_cached_blocks]
                   if self.ref_counts[self.hash_to_block_id[h]] == 0]
        super().allocate(seq, num_cached_blocks)
        self.free_block_ids.extend(revived)


class HashWithoutParent(MyBlockManager):
    """Keys each full block by its own tokens only."""
    def register(self, block, seq, i):
        h = hash(self.tokens_of_block(seq, i))
        self.block_hash[block], self.block_tokens[block] = h, self.tokens_of_block(seq, i)
        self.hash_to_block_id[h] = block


class NeverRegisters(MyBlockManager):
    def register(self, block, seq, i):
        pass


class TableKeptAfterFree(MyBlockManager):
    def free(self, seq):
        table = seq.block_table
        super().free(seq)
        seq.block_table = table


class WholePromptFromCache(MyBlockManager):
    """Ignores num_cached_blocks: shares every full block the cache holds, the last token's too."""
    def allocate(self, seq, num_cached_blocks=0):
        hits = 0
        for h in self.hash_full_blocks(seq):
            hits += h in self.hash_to_block_id
        super().allocate(seq, hits)


class ForgetsOnFree(MyBlockManager):
    """Drops a freed block's hash at once, as if a free block could not stay cached."""
    def free(self, seq):
        for block in seq.block_table:
            if self.ref_counts[block] == 1 and self.block_hash[block] is not None:
                del self.hash_to_block_id[self.block_hash[block]]
        super().free(seq)


class AppendsEveryStep(MyBlockManager):
    def may_append(self, seq):
        seq.block_table.append(self.take_free_block())


@pytest.mark.parametrize("impl, words", [
    (FreesShared, "after free(A), a block still held went back on the free list (block 0 by B, block 1 by B"),
    (NoUserOnHit, "are shared by more sequences than their ref_counts say: a block shared from the cache gets one "
                  "more user, ref_counts[block] += 1"),
    (HitLeftOnFreeList, "shared from the cache but still on the free list, where take_free_block hands them out"),
    (HashWithoutParent, "keyed by the hash of their own tokens only: a block's key must chain on the block before"),
    (NeverRegisters, "allocate(A) registered none of its full blocks"),
    (TableKeptAfterFree, "after free(A), the sequence still has 4 blocks in its block_table"),
    (WholePromptFromCache, "cached is 8, all of G's tokens; can_allocate found 1 block. Share exactly the first "
                           "num_cached_blocks"),
    (AppendsEveryStep, "after may_append(A) at 11 tokens: A holds 4 blocks, it needs 3"),
    (ForgetsOnFree, "free(A) dropped 1 block(s) from the prefix cache (hash_to_block_id held 4 after A's appends, 3 "
                    "after free(A)): a freed block keeps its hash"),
    (NeverRegistersOnAppend, "When may_append completes a block")])
def test_block_manager_bookkeeping_mistakes_are_named(impl, words):
    ok, why = block_manager_probe.diagnose(block_manager_probe.run(impl))
    assert ok is False and words in why, why


# Notebook 05's slot_mapping exercise (a function, checked by nb05.check_slot_mapping) -----------------------------
@pytest.mark.parametrize("fn, words", [
    (lambda bt, ps, bs: [bt[p // bs + 1] * bs + p % bs for p in ps],
     "raised IndexError: list index out of range in your <"),
    (lambda bt, ps, bs: [bt[p // bs + 1] * bs + p % bs for p in ps], "position p's block is entry p // block_size"),
    (lambda bt, ps, bs: [bt[p // bs] * bs + p % bs + 1 for p in ps], "every slot is +1 from the right one"),
    (lambda bt, ps, bs: [bt[p // bs - 1] * bs + p % bs for p in ps],
     "position 0 is in entry p // block_size = 0 of block_table, block 3; your slot 16 is in block 1, entry 1"),
    (lambda bt, ps, bs: [bt[p // bs] * bs + p for p in ps], "the position p is added, not its offset in its block"),
    (lambda bt, ps, bs: [bt[p // bs] * len(bt) + p % bs for p in ps],
     "position 0's slot is block_table[0 // 16] * 16 + 0 % 16 = 3 * 16 + 0 = 48; you gave 6"),
    (lambda bt, ps, bs: [bt[ps[-1] // bs] * bs + ps[-1] % bs], "1 slots for 5 positions; return one slot per"),
    (lambda bt, ps, bs: [bt[p % bs] * bs + p // bs for p in ps], "p % block_size is the offset inside that block")])
def test_slot_mapping_mistakes_are_named(fn, words):
    result = nb05.check_slot_mapping(fn)
    assert result.ok is False and words in result.message, result.message
