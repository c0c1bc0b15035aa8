"""Notebook 01 (the causal-mask NaN): write the causal mask as booleans.

``causal_mask(q_len, k_len)`` -> ``(q_len, k_len)`` bool, True where query i may see key j.
The queries are the *last* ``q_len`` of ``k_len`` positions (a decode step, or a prefill
after a cached prefix), so query i sits at position ``k_len - q_len + i`` and sees keys
``j <= k_len - q_len + i``. Checked against ``tplab.layers.metadata.causal_visible``.
"""
import torch

from tplab.exercises import not_a_tensor, run_checker
from tplab.layers.metadata import causal_visible

# (q_len, k_len): prefill, a single token, decode steps, a chunk after a cached prefix
CASES = [(4, 4), (1, 1), (7, 7), (1, 6), (3, 8), (2, 5)]


def reference_mask(q_len: int, k_len: int) -> torch.Tensor:
    """tplab's mask for one sequence: ``(q_len, k_len)`` bool."""
    return causal_visible(q_len, k_len)


def _diagnose(mine: torch.Tensor, ref: torch.Tensor, q_len: int, k_len: int) -> str:
    """Why ``mine`` differs from ``ref``, in words a learner can act on."""
    where = f"q_len={q_len}, k_len={k_len}"
    if q_len < k_len and torch.equal(mine, torch.ones(q_len, k_len, dtype=torch.bool).tril(q_len - k_len)):
        return (f"{where}: tril(diagonal=q_len - k_len): the offset's sign is flipped. Query i is at position "
                f"k_len - q_len + i = {k_len - q_len} + i, so it is tril(diagonal=k_len - q_len)")
    if torch.equal(mine, ~ref):
        return f"{where}: inverted; True must mean *visible* (the keys a query may attend to)"
    if q_len == k_len and torch.equal(mine, ref.T):
        return (f"{where}: transposed, the upper triangle: query i sees the keys after it. Rows are the queries, "
                "columns the keys; query i sees keys j <= its own position (tril)")
    no_offset = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    if q_len < k_len and torch.equal(mine, no_offset):
        return (f"{where}: this is tril() with no offset; the queries are the last q_len of k_len positions, "
                f"so query i is at position k_len - q_len + i = {k_len - q_len} + i (tril(diagonal=k_len - q_len))")
    diagonal = torch.arange(k_len)[None, :] == (k_len - q_len) + torch.arange(q_len)[:, None]
    if torch.equal(mine, ref & ~diagonal):
        return f"{where}: the diagonal is hidden; a token must see itself (j <= its own position)"
    row = int((mine != ref).any(1).nonzero()[0])
    return (f"{where}: row {row} (query at position {k_len - q_len + row}) sees keys "
            f"{mine[row].nonzero().flatten().tolist()}, expected {ref[row].nonzero().flatten().tolist()}")


def _dtype_message(mine: torch.Tensor, q_len: int, k_len: int) -> str:
    """What a mask of another dtype than bool does, and how to make it bool."""
    ref, fits = reference_mask(q_len, k_len), tuple(mine.shape) == (q_len, k_len)
    hidden = mine[~ref] if fits else mine
    if mine.dtype.is_floating_point and fits and torch.equal(mine == 0, ref) and bool((hidden <= -1e4).all()):
        how = "-inf" if bool(hidden.isneginf().all()) else "a large negative number (such as HF's finfo.min)"
        return (f"dtype {mine.dtype}: an additive mask, 0 where visible and {how} where hidden. Added to the scores "
                "it works, but return booleans, True where visible, as masked_fill and the engine take them: "
                "`mask == 0`, or build it by a comparison")
    right = fits and torch.equal(mine != 0, ref)
    pattern = " Its 1s are in the right places: `.bool()` (or build it by a comparison) is all that is left." \
        if right else ""
    if mine.dtype.is_floating_point and not bool(mine.isfinite().all()):
        return (f"dtype {mine.dtype}: return booleans. A float mask built by multiplying by -inf is exactly the "
                f"bug (0 * -inf = NaN); apply bools with masked_fill.{pattern}")
    return (f"dtype {mine.dtype}: return booleans (torch.bool), True where visible. masked_fill takes only a bool "
            f"mask, and a 0/1 mask added to the scores as a float mask adds 1 to the visible ones instead of hiding "
            f"the others.{pattern}")


def _compare(fn):
    for q_len, k_len in CASES:
        mine = fn(q_len, k_len)
        wrong = not_a_tensor(mine)
        if wrong:
            return False, wrong
        if mine.dtype != torch.bool:
            return False, _dtype_message(mine, q_len, k_len)
        if tuple(mine.shape) != (q_len, k_len):
            flipped = ": (k_len, q_len), transposed; rows are the queries, columns the keys" \
                if tuple(mine.shape) == (k_len, q_len) else ""
            return False, f"q_len={q_len}, k_len={k_len}: shape {tuple(mine.shape)}, expected {(q_len, k_len)}{flipped}"
        ref = reference_mask(q_len, k_len)
        if not torch.equal(mine, ref):
            return False, _diagnose(mine, ref, q_len, k_len)
    return True, f"equal to causal_visible on {len(CASES)} (q_len, k_len) cases, prefill and decode"


def check_causal_mask(fn):
    """Compare ``fn(q_len, k_len)`` with ``causal_visible`` for prefill, decode and cached-prefix shapes."""
    return run_checker("causal_mask", fn, _compare)
