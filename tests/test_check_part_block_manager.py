"""check_part("block_manager", ...): a learner's block manager driven by the real scheduler, and its usual mistakes."""
import sys

import cloudpickle
import pytest

from tplab.exercises import check_part
from tplab.exercises import block_manager_probe
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
    (NeverFrees, "after free(A): used is 7, expected 5"),
    (IgnoresTheCache, "after allocate(B): the same 8-token prefix + 1: cached is"),
    (NeverRegistersOnAppend, "fits is 2, expected 3. A's third block filled up in may_append"),
    (NeverRegistersOnAppend, "register it in the cache")])
def test_block_manager_mistakes_are_named(impl, words):
    result = check_part("block_manager", impl)
    assert result.ok is False and words in result.message, result.message
