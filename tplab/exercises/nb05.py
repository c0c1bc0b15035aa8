"""Exercises of notebook 05 (paged attention): where each token's K/V live in the paged cache.

``check_slot_mapping(fn)`` compares the learner's ``fn(block_table, positions, block_size)``
with the ``slot_mapping`` that ``tplab.layers.metadata.build_metadata`` computes for the
engine, on fixed sequences: a prefill, a decode step, a prompt after a prefix-cache hit,
block tables in any order.
"""
import traceback

import torch

from tplab.exercises import FORGOT_RETURN, ExerciseResult, learner_line, run_checker
from tplab.layers.metadata import build_metadata

# (block_table, first new position, context length, block_size): the new tokens are
# positions first .. context - 1 of one sequence, as the runner feeds them.
CASES = [
    ([0], 0, 5, 16),                    # a short prompt in one block
    ([3, 1], 0, 20, 16),                # a prompt over two blocks, not in id order
    ([3, 1], 19, 20, 16),               # one decode step, in the second block
    ([7, 2, 5], 8, 11, 4),              # three new tokens after two cached (prefix-hit) blocks
    ([4, 0, 9, 6], 0, 13, 4),           # a prompt that ends in a half-full block
    ([2, 8, 1, 3], 12, 13, 4),          # a decode that starts a new block
    ([5], 0, 1, 1),                     # block_size 1: slot == block id
]


def _reference(block_table, positions, block_size) -> torch.Tensor:
    first, context = positions[0], positions[-1] + 1
    meta = build_metadata([context - first], [context], [list(block_table)], block_size, torch.device("cpu"))
    return meta.slot_mapping


def _slots(block_table, positions, block_size) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


MISTAKES = [  # (what the usual mistake computes, what it means)
    (lambda bt, ps, bs: list(ps), "these are the positions themselves: a position is not a slot. Look its block up in "
     "the table: block_table[p // block_size] * block_size + p % block_size"),
    (lambda bt, ps, bs: [bt[p // bs] + p % bs for p in ps], "the block id is not multiplied by block_size: block b's "
     "slots are b * block_size ... b * block_size + block_size - 1"),
    (lambda bt, ps, bs: _slots(bt, range(len(ps)), bs), "the new tokens are counted from 0, not by their positions: "
     "a decode step or a prompt after cached blocks starts at position positions[0], not at 0"),
    (lambda bt, ps, bs: _slots(bt, range(ps[-1] + 1), bs), "a slot for every position up to the last, cached ones "
     "included: only this step's new tokens (the positions given) get a slot"),
    (lambda bt, ps, bs: [(p % bs) * bs + bt[p // bs] for p in ps], "block and offset swapped: slot = block * "
     "block_size + offset, with block = block_table[p // block_size] and offset = p % block_size"),
    (lambda bt, ps, bs: [bt[p // bs] * bs + p for p in ps], "the position p is added, not its offset in its block: "
     "block_table[p // block_size] * block_size + p % block_size"),
]


def _first_wrong(block_table, positions, block_size, got: list[int], want: list[int]) -> str:
    """No usual mistake matched: the first wrong slot, worked out by the formula."""
    if len(got) != len(want):
        return f": {len(got)} slots for {len(positions)} positions; return one slot per position given"
    shifts = {g - w for g, w in zip(got, want)}
    if len(shifts) == 1:
        return (f": every slot is {shifts.pop():+d} from the right one: slot = block_table[p // block_size] * "
                "block_size + p % block_size, nothing added or taken away")
    p, g, w = next((p, g, w) for p, g, w in zip(positions, got, want) if g != w)
    entry, offset = divmod(p, block_size)
    block, off = divmod(g, block_size)
    if off == offset and block in block_table:
        return (f": position {p} is in entry p // block_size = {entry} of block_table, block {block_table[entry]}; "
                f"your slot {g} is in block {block}, entry {block_table.index(block)}")
    if block == block_table[entry]:
        return f": position {p} is at offset p % block_size = {offset} of its block {block}; your slot {g} is at {off}"
    return (f": position {p}'s slot is block_table[{p} // {block_size}] * {block_size} + {p} % {block_size} = "
            f"{block_table[entry]} * {block_size} + {offset} = {w}; you gave {g}")


def _why(block_table, positions, block_size, got: list[int], want: list[int]) -> str:
    for mistake, why in MISTAKES:
        if got == mistake(block_table, positions, block_size):
            return f": {why}"
    return _first_wrong(block_table, positions, block_size, got, want)


def _index_error(fn, error: IndexError, block_table, positions, block_size) -> str:
    """An IndexError from the learner's function (a block_table entry past its end, most likely), in words."""
    line = learner_line(getattr(fn, "__wrapped__", fn), "".join(traceback.format_exception(error)))
    last = positions[-1]
    return (f"block_table {block_table}, positions {positions}, block_size {block_size}: raised IndexError: "
            f"{error}{line}. block_table's entries are 0 to {len(block_table) - 1}: position p's block is entry "
            f"p // block_size (the last position, {last}, is in entry {last // block_size}), no +1; and p % block_size "
            "is the offset inside that block, not the entry")


def _as_slots(got) -> tuple[torch.Tensor | None, str]:
    """``got`` as a flat long tensor, or (None, what to return instead): a list or tensor of integers."""
    what = "return one slot per position: a list of ints or a 1-D integer tensor"
    if isinstance(got, (str, bytes, dict, set)) or not hasattr(got, "__len__"):
        return None, f"returned {type(got).__name__}: {what}"
    try:
        slots = torch.as_tensor(got)
    except (TypeError, ValueError, RuntimeError):
        return None, f"returned a {type(got).__name__} that is not a list of numbers: {what}"
    if slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
        how = ": use // (floor division), not /" if slots.is_floating_point() else ""
        return None, f"slots are integer indices; you returned {slots.dtype}{how}"
    return slots.long().flatten().cpu(), ""                           # any integer dtype is fine: slots


def _compare(fn):
    for block_table, first, context, block_size in CASES:
        positions = list(range(first, context))
        try:
            got = fn(list(block_table), list(positions), block_size)
        except IndexError as e:
            return False, _index_error(fn, e, block_table, positions, block_size)
        if got is None:
            return False, FORGOT_RETURN
        got, what = _as_slots(got)
        if got is None:
            return False, f"block_table {block_table}, positions {positions}, block_size {block_size}: {what}"
        ref = _reference(block_table, positions, block_size)
        if got.shape != ref.shape or not torch.equal(got, ref):
            return False, (f"block_table {block_table}, positions {positions}, block_size {block_size}: "
                           f"got {got.tolist()}, build_metadata gives {ref.tolist()}"
                           f"{_why(block_table, positions, block_size, got.tolist(), ref.tolist())}")
    return True, f"{len(CASES)} cases equal build_metadata's slot_mapping"


def check_slot_mapping(fn) -> ExerciseResult:
    """``fn(block_table, positions, block_size)`` -> one cache slot per position (list or tensor)."""
    return run_checker("slot_mapping", fn, _compare)
