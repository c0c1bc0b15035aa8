"""The seeds' pitfalls, each a drop-in replacement for one part of the engine.

``LLM(..., bugs=["mask_mul_inf"])`` builds the engine with these parts swapped in;
the engine itself has no ``if bug:`` branches. Each replacement's docstring quotes
the pitfall it reproduces.
"""
import dataclasses

import torch.nn.functional as F


def mask_mul_inf_attend(q, k, v, visible, scale):
    """Causal mask built as ``triu(ones) * -inf`` and added to the scores.

    Seed: "you use torch.ones(...) * -inf then add it to scores; the lower triangle
    becomes 0 * -inf = NaN, so scores contain NaN and softmax spreads it everywhere."
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale                        # (B, H, Lq, Lk)
    mask = (~visible).to(scores.dtype) * float("-inf")              # 1 * -inf = -inf, but 0 * -inf = NaN
    return F.softmax(scores + mask, dim=-1) @ v


def no_rope_apply(q, k, cos, sin):
    """RoPE never applied: the model is blind to token order.

    Seed: "your attention.py only does plain dot-product attention, with no rotary
    position embedding applied to q/k."
    """
    return q, k


# name -> (field of tplab.models.qwen2.Parts, replacement)
_PARTS = {
    "mask_mul_inf": ("attend", mask_mul_inf_attend),
    "no_rope": ("apply_rope", no_rope_apply),
}
NAMES = tuple(_PARTS)


def check_names(names) -> list[str]:
    """The bug names, or a ValueError listing the known ones."""
    names = [names] if isinstance(names, str) else list(names or ())
    unknown = [n for n in names if n not in _PARTS]
    if unknown:
        raise ValueError(f"unknown bug name(s) {unknown}; known: {list(NAMES)}")
    return names


def positions_fn(names=()):
    """The runner's token-position function, with the named bugs swapped in."""
    from tplab.engine.runner import token_positions
    return token_positions


def weights_loader(names=()):
    """The checkpoint loader (``tplab.loader.load_weights``), with the named bugs swapped in."""
    from tplab.loader import load_weights
    return load_weights


def describe(name: str) -> str:
    """The pitfall a bug reproduces (its replacement's docstring)."""
    return _PARTS[check_names([name])[0]][1].__doc__.strip()


def parts_with(names=()):
    """``tplab.models.qwen2.Parts`` with the named bugs swapped in."""
    from tplab.models.qwen2 import Parts
    return dataclasses.replace(Parts(), **dict(_PARTS[n] for n in check_names(names)))
