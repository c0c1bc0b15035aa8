"""The checkers of notebooks 05 and 06's index exercises (``slot_mapping``, ``vocab_shard_range``): each accepts
the reference solution, names every plausible mistake beside what tplab computes, reports a stub as not
attempted and an error as a result, never raised."""
import pytest
import torch

from tplab.exercises import nb05, nb06
from tplab.exercises.solutions import define

ceil = lambda v, tp: -(-v // tp)                                          # noqa: E731
per64 = lambda v, tp: ceil(ceil(v, 64) * 64, tp)                          # noqa: E731  rows a rank, vLLM's padding
# exercise -> (its checker, what every rejection shows tplab's answer as, {words naming the mistake: a wrong answer})
CASES = {
    "slot_mapping": (nb05.check_slot_mapping, "build_metadata gives", {
        "a position is not a slot": lambda bt, ps, bs: list(ps),          # as if the cache were one tensor
        "not multiplied by block_size": lambda bt, ps, bs: [bt[p // bs] + p % bs for p in ps],
        "counted from 0, not by their positions": lambda bt, ps, bs: [bt[i // bs] * bs + i % bs
                                                                      for i in range(len(ps))],
        "only this step's new tokens": lambda bt, ps, bs: [bt[p // bs] * bs + p % bs for p in range(ps[-1] + 1)],
        "block and offset swapped": lambda bt, ps, bs: [(p % bs) * bs + bt[p // bs] for p in ps],
        "": lambda bt, ps, bs: [bt[0] * bs + p for p in ps],              # every token in the first block
    }),
    "vocab_shard_range": (nb06.check_vocab_shard_range, "VocabParallelEmbedding holds rows", {
        "last rows belong to no rank": lambda v, r, tp: (r * (v // tp), (r + 1) * (v // tp)),
        "the remainder is given to the last rank": lambda v, r, tp: (r * (v // tp),
                                                                     v if r == tp - 1 else (r + 1) * (v // tp)),
        "the end runs past the vocabulary": lambda v, r, tp: (r * ceil(v, tp), (r + 1) * ceil(v, tp)),
        "end is exclusive": lambda v, r, tp: (r * ceil(v, tp), min((r + 1) * ceil(v, tp), v) - 1),
        "its end is its start, never before it": lambda v, r, tp: (r * ceil(v, tp), min((r + 1) * ceil(v, tp), v)),
        "not how many a rank holds": lambda v, r, tp: (r * ceil(v, tp), ceil(v, tp)),
        "padded to a multiple of 64 first, as vLLM": lambda v, r, tp: (
            r * per64(v, tp), max(r * per64(v, tp), min((r + 1) * per64(v, tp), v))),
    }),
}


def stub(*args):
    raise NotImplementedError


def broken(first, *rest):
    return first[rest]                                                  # TypeError: list indices must be integers


@pytest.mark.parametrize("name", CASES)
def test_the_solution_is_correct(name):
    check, _, _ = CASES[name]
    result = check(define(name)[name])
    assert result.ok is True, result


@pytest.mark.parametrize("name", CASES)
def test_each_mistake_is_named_beside_tplabs_answer(name):
    check, shows, mistakes = CASES[name]
    for words, wrong in mistakes.items():
        result = check(wrong)
        assert result.ok is False and shows in result.message and words in result.message, (words, result.message)


@pytest.mark.parametrize("name", CASES)
def test_a_stub_is_not_attempted_and_an_error_is_reported(name):
    check, _, _ = CASES[name]
    assert check(stub).ok is None and "not attempted" in repr(check(stub))
    result = check(broken)
    assert result.ok is False and "TypeError" in result.message, result.message


def test_slot_mapping_accepts_a_tensor_answer():
    def as_tensor(block_table, positions, block_size):
        p = torch.tensor(positions)
        return torch.tensor(block_table)[p // block_size] * block_size + p % block_size
    assert nb05.check_slot_mapping(as_tensor).ok is True


def test_slot_mapping_refuses_float_slots_and_names_floor_division():
    result = nb05.check_slot_mapping(lambda bt, ps, bs: [bt[p // bs] * bs + p % bs + 0.9 for p in ps])
    assert result.ok is False and "slots are integer indices" in result.message, result.message
    assert "use // (floor division), not /" in result.message


def test_slot_mapping_says_what_to_return_for_a_string():
    result = nb05.check_slot_mapping(lambda bt, ps, bs: "0, 1, 2")
    assert result.ok is False and "raised" not in result.message, result.message
    assert "returned str: return one slot per position: a list of ints or a 1-D integer tensor" in result.message


def test_vocab_shard_range_says_what_to_return_for_an_int_or_floats():
    result = nb06.check_vocab_shard_range(lambda v, r, tp: v // tp)
    assert result.ok is False and "returned int 2048: return (start, end), two ints" in result.message, result.message
    result = nb06.check_vocab_shard_range(lambda v, r, tp: (r * v / tp, min((r + 1) * -(-v // tp), v)))
    assert result.ok is False and "use // (floor division), not /" in result.message, result.message


def test_vocab_shard_range_takes_any_empty_range_for_a_rank_of_padding_only():
    """vocab 10 over 8 ranks: ranks 5-7 hold padding only; (10, 10) says so as well as the engine's (12, 12)."""
    def clamped(v, r, tp):
        return min(r * ceil(v, tp), v), min((r + 1) * ceil(v, tp), v)
    assert nb06.check_vocab_shard_range(clamped).ok is True
