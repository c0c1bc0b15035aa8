"""An optional finite check: stop at the first sublayer whose output has NaN or inf, and name it,
instead of letting NaN flow silently to the logits (where it shows up as token 0 forever)."""
import torch
from torch import nn

from tplab.models.pipeline import PPMissingLayer


class NonFiniteError(FloatingPointError):
    """An activation that is NaN or inf, reported at the first module (in forward order) that made it."""


def _watched(model: nn.Module) -> list[tuple[str, nn.Module]]:
    names = ["model.embed_tokens"]
    for i in range(len(model.model.layers)):
        names += [f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"]
    modules = dict(model.named_modules())   # under pipeline parallelism, only this stage's are there
    return [(n, modules[n]) for n in names + ["model.norm"]
            if n in modules and not isinstance(modules[n], PPMissingLayer)]


def install_finite_check(model: nn.Module) -> list:
    """Forward hooks that raise ``NonFiniteError`` at the first non-finite output; returns the handles.

    Each check costs a reduction over the activation, so it is opt-in
    (``LLM(..., check_finite=True)``); notebook 01 turns it on.
    """
    def check(name):
        def hook(_, __, out):
            bad = ~torch.isfinite(out)
            if bad.any():
                raise NonFiniteError(f"{name} produced {int(bad.sum())} non-finite value(s) of {out.numel()} "
                                     f"(first NaN/inf in forward order; everything before it was finite)")
        return hook
    return [module.register_forward_hook(check(name)) for name, module in _watched(model)]
