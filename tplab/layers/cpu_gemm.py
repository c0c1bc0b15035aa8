"""How a linear layer multiplies on CPU: oneDNN's inner product, and weights packed for it once after
loading (vLLM's "process weights after loading").

Why oneDNN: torch's default CPU path (MKL) streams fp32 weights at about half the memory bandwidth for
the few rows of a decode step, and decode is nothing but streaming weights (bench/ measures it). Same
maths; the summation order differs at the 1e-7 level. Why packing: a matmul over the 16 rows of a batch
of decodes runs about 1.5x faster on a weight reordered into oneDNN's blocked layout, a prefill's about
10% faster, and a bf16 weight streams half the bytes of fp32 only when packed (on a plain one oneDNN
reorders it on every call). The price: a single sequence's fp32 decode (one row) runs about 10% slower
than on the plain layout (bench/, README).

A layer says what it does with this by being a ``GemmLayer``: the engine calls its
``process_weights_after_loading(gemm)`` once, after the checkpoint is loaded, with the ``Gemm`` the
config chose (``EngineConfig.onednn``, ``EngineConfig.pack_weights``). A part that is not a
``GemmLayer`` is left as it is and multiplies however its own ``forward`` does.
"""
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The row count oneDNN is told to pack a weight for. It picks the layout from it: here 4 and 16 give
# the same blocked layout (AB16b64a), 1 gives the plain one (no faster at 16 rows).
PACK_FOR_ROWS = 4


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs oneDNN's inner product on ``dtype`` here, and gets ``F.linear``'s answer.
    A cache: a fact about the torch build and the CPU, probed once per process and dtype. bf16 needs the
    CPU's own bf16 support (AVX-512 or AVX-NE-CONVERT): on an AVX2-only CPU oneDNN has no bf16 inner
    product, and a bf16 layer multiplies with ``F.linear`` as HF does."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 3, dtype=dtype), torch.ones(4, 3, dtype=dtype)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs ``dtype`` weights here and multiplies by them correctly (a cache, as above)."""
    if dtype not in (torch.float32, torch.bfloat16) or not onednn_available(dtype):
        return False
    try:
        x, w = torch.ones(2, 32, dtype=dtype), torch.ones(8, 32, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class Gemm:
    """How ``linear`` multiplies: ``Gemm()`` is plain ``F.linear``; ``onednn`` goes through oneDNN's inner
    product on CPU tensors; ``pack`` lets a layer reorder its weight for it once after loading. A ``Gemm``
    is chosen for one dtype, the model's: ``choose`` keeps only what this machine does in that dtype."""
    onednn: bool = False
    pack: bool = False

    @classmethod
    def choose(cls, onednn: bool, pack: bool, dtype: torch.dtype = torch.float32) -> "Gemm":
        """What this machine can do of what was asked, for weights and activations of ``dtype``."""
        onednn = onednn and onednn_available(dtype)
        return cls(onednn, onednn and pack and packing_available(dtype))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``weight`` may be a plain tensor or one from ``packed``."""
        if self.onednn and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def can_pack(self, weight: torch.Tensor) -> bool:
        """Whether ``packed(weight)`` packs: packing chosen, a CPU weight of a dtype oneDNN packs here."""
        return self.pack and weight.device.type == "cpu" and packing_available(weight.dtype)

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` reordered once into oneDNN's blocked layout for ``linear`` (None where it cannot be)."""
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS) if self.can_pack(weight) else None


class GemmLayer:
    """Mixed into a layer whose ``forward`` multiplies through ``self.gemm``. Until the engine calls
    ``process_weights_after_loading(gemm)`` the layer multiplies with plain ``F.linear``.

    ``packs_weight``: whether ``forward`` reads the packed weight the processing leaves. A subclass that
    defines a ``forward`` of its own reads ``self.weight`` itself, so it gets ``packs_weight = False``
    unless its class body says otherwise: its weight stays as it was loaded."""
    gemm = Gemm()
    packs_weight = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in vars(cls) and "packs_weight" not in vars(cls):
            cls.packs_weight = False

    def process_weights_after_loading(self, gemm: Gemm) -> bool:
        """Adopt ``gemm`` and, where it packs, prepare the weight for it; whether anything was packed."""
        raise NotImplementedError


def process_weights_after_loading(model: torch.nn.Module, gemm: Gemm) -> int:
    """After loading: give every ``GemmLayer`` of ``model`` the config's ``gemm``; how many packed."""
    return sum(bool(m.process_weights_after_loading(gemm)) for m in model.modules() if isinstance(m, GemmLayer))
