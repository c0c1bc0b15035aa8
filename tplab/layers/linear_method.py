"""How a layer multiplies by its weight, as a part of its own: vLLM's ``quant_method``.

A tensor-parallel layer decides what to multiply (its shard of the weight) and what to communicate; how the
product is computed on a given machine is its ``linear_method``'s business. Here it is plain ``F.linear``;
the engine hands each layer another after loading (``Parts.gemm``, docs/api.md), and the layer's code does
not change.
"""
import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """``apply(layer, x, bias) = x @ layer.weight.T + bias``, with nothing done to the weight after loading."""

    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        """Called once after the checkpoint is loaded; whether this method will multiply by a copy of the weight
        of its own (a packed one: ``tplab.kernels.gemm``), rather than by ``layer.weight`` as loaded."""
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``(T, in_local) -> (T, out_local)``."""
        return F.linear(x, layer.weight, bias)

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for a plain weight the layer slices itself (one expert's of a stacked tensor)."""
        return F.linear(x, weight)


class UsesLinearMethod:
    """Mixed into a layer that multiplies by its ``weight`` through ``self.linear_method.apply(self, x, bias)``
    (tplab's linear layers and LM head): after loading, the engine hands it a method of its own
    (``hand_out_linear_methods`` below). Until then it multiplies with plain ``F.linear``."""
    linear_method: LinearMethod = LinearMethod()


class UsesProducts:
    """Mixed into a layer whose weights are stacked (an MoE layer's experts): it slices one expert's weight and
    multiplies through ``self.linear_method.product(x, weight)``. After loading, the engine hands it a method
    of its own, which never takes the weights over (they stay plain, to be sliced)."""
    linear_method: LinearMethod = LinearMethod()


def hand_out_linear_methods(model: nn.Module, gemm) -> int:
    """After loading: give every ``UsesLinearMethod`` and ``UsesProducts`` layer of ``model`` its own
    ``gemm.method_for(name)`` (``gemm``: ``Parts.gemm``, chosen for this machine; ``name``: its module name,
    vLLM's ``prefix``, e.g. ``model.layers.0.mlp.down_proj``), and ask each linear layer's method whether it will
    multiply by a copy of the weight of its own (``process_weights_after_loading``; tplab's packs it at the layer's
    first product). Returns how many of them will."""
    taken = 0
    for name, module in model.named_modules():
        if isinstance(module, UsesLinearMethod):
            module.linear_method = gemm.method_for(name)
            taken += bool(module.linear_method.process_weights_after_loading(module))
        elif isinstance(module, UsesProducts):
            module.linear_method = gemm.method_for(name)
    return taken
