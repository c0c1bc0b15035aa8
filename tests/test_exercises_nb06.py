"""The notebook 06 checker accepts the solution, rejects plausible mistakes, and reports a stub."""
from tplab.exercises import nb06
from tplab.exercises.solutions import define

SOLUTION = define("vocab_shard_range")["vocab_shard_range"]


def test_vocab_shard_range_solution_is_correct():
    result = nb06.check_vocab_shard_range(SOLUTION)
    assert result.ok is True, result


def test_vocab_shard_range_rejects_floor_division():
    def wrong(vocab_size, rank, tp):                      # no padding: rows past tp * (vocab // tp) are lost
        per_rank = vocab_size // tp
        return rank * per_rank, (rank + 1) * per_rank
    result = nb06.check_vocab_shard_range(wrong)
    assert result.ok is False and "VocabParallelEmbedding holds rows" in result.message


def test_vocab_shard_range_rejects_unclamped_end():
    def wrong(vocab_size, rank, tp):                      # the last rank's padding counted as real rows
        per_rank = -(-vocab_size // tp)
        return rank * per_rank, (rank + 1) * per_rank
    assert nb06.check_vocab_shard_range(wrong).ok is False


def test_vocab_shard_range_stub_is_not_attempted():
    def stub(vocab_size, rank, tp):
        raise NotImplementedError
    result = nb06.check_vocab_shard_range(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_vocab_shard_range_counterexamples_come_with_a_diagnosis():
    ceil = lambda v, tp: -(-v // tp)
    mistakes = {
        "last rows belong to no rank": lambda v, r, tp: (r * (v // tp), (r + 1) * (v // tp)),
        "the remainder is given to the last rank": lambda v, r, tp: (r * (v // tp),
                                                                     v if r == tp - 1 else (r + 1) * (v // tp)),
        "the end runs past the vocabulary": lambda v, r, tp: (r * ceil(v, tp), (r + 1) * ceil(v, tp)),
        "end is exclusive": lambda v, r, tp: (r * ceil(v, tp), min((r + 1) * ceil(v, tp), v) - 1),
    }
    for words, wrong in mistakes.items():
        result = nb06.check_vocab_shard_range(wrong)
        assert result.ok is False and "VocabParallelEmbedding holds rows" in result.message \
            and words in result.message, (words, result.message)
