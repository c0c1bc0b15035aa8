"""The notebook 05 checker accepts the solution, rejects plausible mistakes, and reports a stub."""
from tplab.exercises import nb05
from tplab.exercises.solutions import define

SOLUTION = define("slot_mapping")["slot_mapping"]


def test_slot_mapping_solution_is_correct():
    assert nb05.check_slot_mapping(SOLUTION).ok is True


def test_slot_mapping_accepts_a_tensor_answer():
    import torch

    def as_tensor(block_table, positions, block_size):
        p = torch.tensor(positions)
        return torch.tensor(block_table)[p // block_size] * block_size + p % block_size
    assert nb05.check_slot_mapping(as_tensor).ok is True


def test_slot_mapping_rejects_block_id_not_scaled():
    def wrong(block_table, positions, block_size):       # forgot "* block_size"
        return [block_table[p // block_size] + p % block_size for p in positions]
    result = nb05.check_slot_mapping(wrong)
    assert result.ok is False and "build_metadata gives" in result.message


def test_slot_mapping_rejects_contiguous_positions():
    def wrong(block_table, positions, block_size):       # as if the cache were one contiguous tensor
        return list(positions)
    assert nb05.check_slot_mapping(wrong).ok is False


def test_slot_mapping_rejects_first_block_only():
    def wrong(block_table, positions, block_size):       # every token in the first block
        return [block_table[0] * block_size + p for p in positions]
    assert nb05.check_slot_mapping(wrong).ok is False


def test_slot_mapping_stub_is_not_attempted():
    def stub(block_table, positions, block_size):
        raise NotImplementedError
    result = nb05.check_slot_mapping(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_slot_mapping_error_is_reported_not_raised():
    def broken(block_table, positions, block_size):
        return block_table[positions]                     # TypeError: list indices
    result = nb05.check_slot_mapping(broken)
    assert result.ok is False and "TypeError" in result.message


def test_slot_mapping_counterexamples_come_with_a_diagnosis():
    mistakes = {
        "a position is not a slot": lambda bt, ps, bs: list(ps),
        "not multiplied by block_size": lambda bt, ps, bs: [bt[p // bs] + p % bs for p in ps],
        "counted from 0, not by their positions": lambda bt, ps, bs: [bt[i // bs] * bs + i % bs
                                                                      for i in range(len(ps))],
        "only this step's new tokens": lambda bt, ps, bs: [bt[p // bs] * bs + p % bs for p in range(ps[-1] + 1)],
        "block and offset swapped": lambda bt, ps, bs: [(p % bs) * bs + bt[p // bs] for p in ps],
    }
    for words, wrong in mistakes.items():
        result = nb05.check_slot_mapping(wrong)
        assert result.ok is False and "build_metadata gives" in result.message and words in result.message, \
            (words, result.message)
