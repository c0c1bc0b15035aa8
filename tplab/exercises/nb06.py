"""Exercises of notebook 06 (full TP generation): which vocabulary rows a rank holds.

``check_vocab_shard_range(fn)`` compares the learner's ``fn(vocab_size, rank, tp)`` ->
``(start, end)`` with the real rows of ``tplab.layers.VocabParallelEmbedding`` built for that
rank: the vocab is padded up to a multiple of ``tp``, every rank holds the same number of
rows, and the last rank may hold fewer real ones (a rank that holds only padding has no real row: any
empty range is accepted for it).
"""
import operator

import torch

from tplab.exercises import FORGOT_RETURN, ExerciseResult, run_checker
from tplab.layers.embed_head import VocabParallelEmbedding

# (vocab_size, tp): divisible, odd, and small vocabularies where padding shows.
CASES = [(2048, 1), (2048, 2), (2048, 4), (251, 2), (251, 4), (10, 4), (7, 4), (10, 8), (151936, 8), (151655, 8)]


def _reference(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    emb = VocabParallelEmbedding(vocab_size, 1, tp_rank=rank, tp_size=tp)   # embedding_dim 1: cheap to build
    return emb.vocab_start, emb.vocab_start + emb.num_real_rows


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _per_rank_64(v: int, tp: int) -> int:
    """Rows a rank holds where the vocabulary is first padded to a multiple of 64, as vLLM pads it."""
    return _ceil(_ceil(v, 64) * 64, tp)


MISTAKES = [  # (what the usual mistake computes, what it means)
    (lambda v, r, tp: (r * (v // tp), (r + 1) * (v // tp)), "vocab_size // tp rows per rank: when tp does not divide "
     "the vocabulary, its last rows belong to no rank. Pad it up: every rank holds per_rank = ceil(vocab_size / tp)"),
    (lambda v, r, tp: (r * (v // tp), v if r == tp - 1 else (r + 1) * (v // tp)), "the remainder is given to the "
     "last rank; VocabParallelEmbedding pads the vocabulary instead, so that every rank holds the same "
     "per_rank = ceil(vocab_size / tp) rows: rank r starts at r * per_rank"),
    (lambda v, r, tp: (r * _ceil(v, tp), (r + 1) * _ceil(v, tp)), "the end runs past the vocabulary: the padding rows "
     "are not real rows. end = min((r + 1) * per_rank, vocab_size), and never before start"),
    (lambda v, r, tp: (r * _ceil(v, tp), min((r + 1) * _ceil(v, tp), v) - 1), "end is exclusive: [start, end) holds "
     "end - start rows, so end = min((r + 1) * per_rank, vocab_size), not one less"),
    (lambda v, r, tp: (r * _ceil(v, tp), min((r + 1) * _ceil(v, tp), v)), "a rank that starts past the vocabulary "
     "holds padding only, no real row: its end is its start, never before it"),
    (lambda v, r, tp: (r * _ceil(v, tp), _ceil(v, tp)), "the second number is where the rows end (exclusive), not "
     "how many a rank holds: end = min(start + per_rank, vocab_size)"),
    (lambda v, r, tp: (r * _per_rank_64(v, tp), max(r * _per_rank_64(v, tp), min((r + 1) * _per_rank_64(v, tp), v))),
     "the vocabulary is padded to a multiple of 64 first, as vLLM pads it; tplab's VocabParallelEmbedding pads "
     "it only to a multiple of tp: per_rank = ceil(vocab_size / tp)"),
]


def _why(fn, vocab_size: int, tp: int) -> str:
    """The usual mistake ``fn`` makes on every rank of this (vocab_size, tp), in words; "" if none fits."""
    try:
        got = [_rows(fn(vocab_size, r, tp)) for r in range(tp)]
    except Exception:          # e.g. None on another rank: the counterexample alone says enough
        return ""
    for mistake, why in MISTAKES:
        if got == [mistake(vocab_size, r, tp) for r in range(tp)]:
            return f": {why}"
    return ""


def _rows(got) -> tuple[int, int] | None:
    """``got`` as (start, end) if it is two integers (ints, or integer 0-d tensors), else None."""
    if isinstance(got, (str, bytes, dict, set)) or not hasattr(got, "__len__"):
        return None
    try:
        return tuple(operator.index(x) for x in got) if len(got) == 2 else None
    except TypeError:          # a float (from /), a string, a tensor of several numbers, a 0-d tensor
        return None


def _not_rows(got) -> str:
    """What is wrong with ``got``, which is not two ints."""
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    if any(isinstance(x, float) or (isinstance(x, torch.Tensor) and x.is_floating_point())
           for x in (got if isinstance(got, (list, tuple)) else ())):
        return f"returned {shown}: start and end are row indices, two ints: use // (floor division), not /"
    return f"returned {type(got).__name__} {shown}: return (start, end), two ints"


def _compare(fn):
    n = 0
    for vocab_size, tp in CASES:
        for rank in range(tp):
            returned = fn(vocab_size, rank, tp)
            if returned is None:
                return False, FORGOT_RETURN
            got, ref = _rows(returned), _reference(vocab_size, rank, tp)
            if got is None:
                return False, f"vocab_size {vocab_size}, tp {tp}, rank {rank}: {_not_rows(returned)}"
            if got != ref and not (got[0] == got[1] and ref[0] == ref[1]):    # no real row: any empty range
                return False, (f"vocab_size {vocab_size}, tp {tp}, rank {rank}: got {got}, "
                               f"VocabParallelEmbedding holds rows {ref}{_why(fn, vocab_size, tp)}")
            n += 1
    return True, f"{n} (vocab_size, rank, tp) cases equal VocabParallelEmbedding's rows"


def check_vocab_shard_range(fn) -> ExerciseResult:
    """``fn(vocab_size, rank, tp)`` -> ``(start, end)``: the real rows ``[start, end)`` rank ``rank`` holds."""
    return run_checker("vocab_shard_range", fn, _compare)
