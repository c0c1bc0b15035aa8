"""Notebook 04 (the GQA KV cache): repeat the KV heads for the score computation.

``repeat_kv(k, n_rep)``: k ``(B, H_kv, T, D)`` -> ``(B, H_kv * n_rep, T, D)`` where query head
``h`` reads KV head ``h // n_rep``: each KV head is copied ``n_rep`` times next to itself
(heads 0, 0, 1, 1, ...), not the whole set tiled (0, 1, 0, 1, ...). Checked against HF's
``transformers.models.qwen2.modeling_qwen2.repeat_kv``.
"""
import torch

from tplab.exercises import not_a_tensor, run_checker

# (B, H_kv, T, D, n_rep): GQA groups of 2 and 3, MQA (one KV head), no repeat, a batch of 2
CASES = [(1, 2, 5, 4, 2), (2, 3, 4, 2, 2), (1, 2, 3, 4, 3), (1, 1, 4, 2, 4), (2, 4, 3, 2, 1)]


def hf_repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF Qwen2's own ``repeat_kv``."""
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv
    return repeat_kv(k, n_rep)


def checker_kv(b: int, h_kv: int, t: int, d: int) -> torch.Tensor:
    """A fixed ``(B, H_kv, T, D)`` tensor whose KV head ``g`` holds the value ``g`` plus a small ramp,
    so every head is told apart by its whole part."""
    ramp = torch.arange(b * t * d, dtype=torch.float32).reshape(b, 1, t, d) / (b * t * d)
    return torch.arange(h_kv, dtype=torch.float32)[None, :, None, None] + ramp


def _heads(x: torch.Tensor) -> list[int]:
    """Which KV head each output head came from (the whole part of the checker's values)."""
    return x[0, :, 0, 0].floor().int().tolist()


def _first_difference(mine: torch.Tensor, k: torch.Tensor, n_rep: int) -> str:
    """The heads come from the right KV heads, but some values differ: the first such [b, h, t, d] in words."""
    b, h, t, d = (mine != hf_repeat_kv(k, n_rep)).nonzero()[0].tolist()
    got, want = float(mine[b, h, t, d]), float(k[b, h // n_rep, t, d])
    source = (k == got).nonzero()
    came = (f"which is k{source[0].tolist()}: values moved to another token or head_dim position (a copy of a KV "
            "head keeps its (T, D) layout)" if len(source) else
            "a value k does not hold: repeat_kv only copies, it changes no value")
    return (f"each output head starts from the right KV head {_heads(mine)}, but at [b, h, t, d] = {[b, h, t, d]} "
            f"you hold {got:.4g}, {came}; query head {h} reads KV head h // n_rep = {h // n_rep}, which holds "
            f"k[{b}, {h // n_rep}, {t}, {d}] = {want:.4g} there")


def _shape_mistake(got: tuple, k: tuple, n_rep: int) -> str:
    """What a wrong shape says about the repeat, or ""."""
    b, h_kv, t, d = k
    if got == k:
        return ": k came back as it is, H_kv heads; repeat each n_rep times"
    if len(got) == 1:
        return ": repeat_interleave without dim flattens k; repeat along the heads, dim=1"
    if got == (b, h_kv, n_rep, t, d):
        return ": reshape the (B, H_kv, n_rep, T, D) expand to (B, H_kv * n_rep, T, D)"
    if len(got) == 4 and got[1] != h_kv and got[1] % h_kv == 0 and got[0] == b and got[2:] == (t, d):
        return f": each head repeated {got[1] // h_kv} times; repeat it n_rep = {n_rep} times (use the argument)"
    grown = [i for i in range(4) if len(got) == 4 and got[i] == k[i] * n_rep
             and got[:i] + got[i + 1:] == k[:i] + k[i + 1:]]
    if grown:
        return f": repeated along dim {grown[0]} ({'BHTD'[grown[0]]}); the KV heads are dim 1"
    return ""


def _compare(fn):
    for b, h_kv, t, d, n_rep in CASES:
        k = checker_kv(b, h_kv, t, d)
        try:
            mine = fn(k.clone(), n_rep)
        except RuntimeError as e:                 # k.view(B, H_kv * n_rep, T, D): a view makes no copies
            said = f"H_kv={h_kv}, n_rep={n_rep}: raised RuntimeError: {e}."
            if "is invalid for input of size" in str(e):
                return False, (f"{said} view and reshape only rearrange k's values, they cannot make the n_rep "
                               "copies: expand (or repeat_interleave) first")
            if "expanded size of the tensor" in str(e):   # k.expand(B, H_kv * n_rep, T, D)
                return False, (f"{said} expand only stretches dims of size 1: give k one first, k[:, :, None] "
                               "(B, H_kv, 1, T, D), expand that to (B, H_kv, n_rep, T, D), then reshape")
            raise
        wrong = not_a_tensor(mine)
        if wrong:
            return False, wrong
        ref = hf_repeat_kv(k, n_rep)
        where = f"H_kv={h_kv}, n_rep={n_rep}"
        if tuple(mine.shape) != tuple(ref.shape):
            return False, (f"{where}: shape {tuple(mine.shape)}, expected (B, H_kv * n_rep, T, D) = {tuple(ref.shape)}"
                           f"{_shape_mistake(tuple(mine.shape), tuple(k.shape), n_rep)}")
        if mine.dtype != ref.dtype:
            return False, (f"{where}: returned {mine.dtype}, but k is {ref.dtype}, the dtype the engine's KV cache "
                           "has: keep k's dtype (expand, repeat_interleave and reshape do)")
        if not torch.equal(mine, ref):
            if torch.equal(mine, k.repeat(1, n_rep, 1, 1)):
                return False, (f"{where}: heads come out as KV heads {_heads(mine)}: that is `repeat` (or "
                               f"torch.cat([k] * n_rep, 1)), which tiles the whole set; query head h reads KV head "
                               f"h // n_rep, so the order must be "
                               f"{_heads(ref)} (`repeat_interleave`, or expand + reshape)")
            if _heads(mine) != _heads(ref):
                return False, f"{where}: heads come from KV heads {_heads(mine)}, expected {_heads(ref)}"
            return False, f"{where}: {_first_difference(mine, k, n_rep)}"
    return True, f"equal to HF's repeat_kv on {len(CASES)} shapes (GQA, MQA, n_rep 1)"


def check_repeat_kv(fn):
    """Compare ``fn(k, n_rep)`` with HF Qwen2's ``repeat_kv`` on GQA, MQA and no-repeat shapes."""
    return run_checker("repeat_kv", fn, _compare)
