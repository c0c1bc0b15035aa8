"""Notebook 03 (RoPE shapes): rotate q or k in tplab's layout.

``apply_rope(x, cos, sin)``: x ``(T, H, D)`` (tokens, heads, head_dim), cos/sin ``(T, D)``
(one row per token, HF's halves layout ``cat(freqs, freqs)``); returns x rotated, ``(T, H, D)``.
Checked against HF's ``apply_rotary_pos_emb``, which wants q/k as ``(B, H, T, D)``, on random
inputs, including shapes where a wrong layout broadcasts without an error (T == H, T == 1).
"""
import torch

from tplab.bugs.rope import no_rope_apply, rope_cos_sin_axis_apply, rope_layout_apply
from tplab.exercises import FORGOT_RETURN, run_checker
from tplab.layers.rotary import rotate_half

# (T, H, D): a general prefill, T == H (a wrong axis still broadcasts), one decode token, one head
CASES = [(5, 3, 8), (4, 4, 8), (1, 2, 16), (6, 1, 8)]
TOL = 1e-5
HEADS_FIRST = ("(H, T, D), HF's layout: tplab keeps tokens first, (T, H, D); give cos/sin a head axis "
               "(cos[:, None, :]) instead of transposing x")


def rope_table(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """cos, sin ``(T, D)`` for ``positions`` ``(T,)``, HF's layout: ``cat(freqs, freqs)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]          # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                          # (T, D)
    return emb.cos(), emb.sin()


def hf_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` on x ``(T, H, D)``: as ``(1, H, T, D)`` with cos ``(1, T, D)``, and back."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    q = x.transpose(0, 1)[None]                                      # (1, H, T, D), HF's layout
    out, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None], unsqueeze_dim=1)  # cos -> (1, 1, T, D)
    return out[0].transpose(0, 1)                                    # (T, H, D)


def _known_mistakes(x, cos, sin):
    """name -> (what it computes, what to tell the learner): the ``rope`` bugs' rotations of x, and a sign."""
    def as_bug(apply_rope):                                          # a bug rotates (q, k): x as both
        return apply_rope(x, x, cos, sin)[0]
    c, s, (x1, x2) = cos[:, None, :], sin[:, None, :], x.chunk(2, -1)
    mistakes = {
        "no rotation": (as_bug(no_rope_apply), "returned x unchanged: no rotation at all (the `no_rope` bug)"),
        "interleaved": (as_bug(rope_layout_apply),
                        "rotates interleaved pairs (x0, x1), (x2, x3), ...; HF's table is cat(freqs, freqs), "
                        "which pairs x_i with x_{i + D/2} (rotate_half): the `rope_layout` bug"),
        "sign": (x * cos[:, None, :] - rotate_half(x) * sin[:, None, :],
                 "rotates the wrong way: the sign of the sin term is flipped"),
        "half": (x * c + torch.cat((-x1, x2), -1) * s, "negates the wrong half: rotate_half(x) is cat(-x2, x1), the "
                 "second half negated and moved first"),
        "no minus": (x * c + torch.cat((x2, x1), -1) * s, "rotate_half(x) is cat(-x2, x1): without the minus "
                     "the pairs are not rotated (a rotation by angle t takes (a, b) to (a cos t - b sin t, b cos t + a sin t))"),
        "cos twice": (x * c + rotate_half(x) * c, "multiplies both terms by cos: x * cos + rotate_half(x) * sin"),
        "swapped": (x * s + rotate_half(x) * c, "cos and sin swapped: x * cos + rotate_half(x) * sin"),
    }
    if x.shape[1] > 1:                                               # x.chunk(2, dim=1): halves of the heads
        h1, h2 = x.chunk(2, 1)
        mistakes["heads halves"] = (x * c + torch.cat((-h2, h1), 1) * s, "split x along dim 1, the heads: "
                                    "rotate_half splits the last dim, head_dim D (x.chunk(2, dim=-1))")
    if x.shape[0] == x.shape[1]:                                     # T == H: (T, D) broadcasts as (1, T, D)
        mistakes["heads first"] = (hf_reference(x, cos, sin).transpose(0, 1), HEADS_FIRST)   # and fits (H, T, D)
        mistakes["heads axis"] = (as_bug(rope_cos_sin_axis_apply),
                                  "cos/sin (T, D) broadcast against (T, H, D) as (1, T, D), i.e. along the "
                                  "heads axis, not the tokens: give them a head axis, cos[:, None, :]")
    return mistakes


def _run_case(fn, T, H, D, gen):
    """(status, detail) for one shape: 'ok', 'raised', 'type', 'shape', 'dtype' or 'silent' (ran, wrong numbers);
    status None when ``fn`` returned None, which ends the check at once."""
    x = torch.randn(T, H, D, generator=gen)
    positions = torch.randint(0, 200, (T,), generator=gen)
    cos, sin = rope_table(positions, D)
    ref = hf_reference(x, cos, sin)
    try:
        mine = fn(x.clone(), cos.clone(), sin.clone())
    except NotImplementedError:
        raise
    except Exception as e:
        return "raised", f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if mine is None:
        return None, FORGOT_RETURN
    if not isinstance(mine, torch.Tensor):
        return "type", f"returned {type(mine).__name__}, expected a torch.Tensor (T, H, D) = {(T, H, D)}"
    if T != H and tuple(mine.shape) == (H, T, D):
        return "shape", f"returned {(H, T, D)}: {HEADS_FIRST}"
    if tuple(mine.shape) != (T, H, D):
        return "shape", f"returned {tuple(mine.shape)}, expected {(T, H, D)}: cos/sin broadcast to the wrong shape"
    if mine.dtype != x.dtype:
        return "dtype", (f"returned {mine.dtype}, but x, cos and sin are {x.dtype}, the dtype the engine runs "
                         "attention in: keep x's dtype (no .double(), no float64 tables)")
    err = float((mine.float() - ref).abs().max())
    if err <= TOL:
        return "ok", f"max_abs {err:.1e}"
    for expected, why in _known_mistakes(x, cos, sin).values():
        if torch.allclose(mine.float(), expected, atol=TOL):
            return "silent", why
    return "silent", (f"max_abs {err:.1e} against HF; it is x * cos + rotate_half(x) * sin, cos and sin as "
                      "(T, 1, D), rotate_half(x) = cat(-x2, x1) of x's halves along D")


def _compare(fn):
    gen = torch.Generator().manual_seed(0)
    results = {}
    for T, H, D in CASES:
        status, detail = _run_case(fn, T, H, D, gen)
        if status is None:
            return False, detail
        results[(T, H, D)] = (status, detail)
    bad = {shape: r for shape, r in results.items() if r[0] != "ok"}
    if not bad:
        return True, f"equal to HF's apply_rotary_pos_emb on {len(CASES)} shapes (T, H, D), T == H and T == 1 included"
    lines = []
    for (T, H, D), (status, detail) in bad.items():
        where = f"T={T}, H={H}, D={D}"
        if status == "silent":
            lines.append(f"{where}: ran without an error but the numbers are wrong (silent): {detail}")
        else:
            lines.append(f"{where}: {detail}")
    if any(s == "silent" for s, _ in bad.values()) and any(s == "raised" for s, _ in bad.values()):
        lines.append("the same code errors for some shapes and silently broadcasts wrong for others")
    return False, "\n  ".join(lines)


def check_apply_rope(fn):
    """Compare ``fn(x (T, H, D), cos (T, D), sin (T, D))`` with HF's ``apply_rotary_pos_emb``."""
    return run_checker("apply_rope", fn, _compare)
