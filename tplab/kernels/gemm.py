"""How a linear layer multiplies on CPU: oneDNN's inner product, on weights packed for it once (vLLM's
"process weights after loading"), and MKL for products of a few rows where MKL streams them faster.

A decode step is nothing but streaming weights, and torch's default CPU path streams fp32 weights slower
than oneDNN for the few rows of a decode step; a weight reordered into oneDNN's blocked layout multiplies
a batch of rows faster still, and a bf16 weight streams half the bytes of fp32 only when packed. The same
maths, summed in another order. ``Gemm`` is ``Parts.gemm``: ``choose`` keeps what this machine does well in
the model's dtype, and ``method_for(prefix)`` gives each layer its ``GemmMethod`` (which layers keep a
plain weight is decided here, from the layer's name). Contract: docs/api.md; measurements: the performance
page (docs/performance.md).
"""
import functools
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tplab.layers.linear_method import LinearMethod

# The row count oneDNN is told to pack a weight for. It picks the layout from it: 1 gives the plain one,
# a few rows a blocked one (which layout, measured: docs/performance-journal.md).
PACK_FOR_ROWS = 4
# Products of at most this many rows (a decode step of one or two sequences) are what MKL's matrix-vector
# kernel wins, where ``few_rows_mkl``; from a few rows up oneDNN's kernels win (docs/performance-journal.md).
FEW_ROWS = 2


def cpu_vendor() -> str:
    """The CPU's vendor string where the OS says it (``GenuineIntel``, ``AuthenticAMD``), else ''."""
    try:
        with open("/proc/cpuinfo") as f:                                   # Linux
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    name = platform.processor()                                            # Windows: '... GenuineIntel'
    return next((v for v in ("GenuineIntel", "AuthenticAMD") if v in name), "")


@functools.cache
def mkl_fast_here() -> bool:
    """Whether MKL is the fastest kernel here for fp32 products of a few rows: torch is built with MKL and
    the CPU is Intel's (on AMD MKL takes a slower generic path)."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def one_row_keeps_plain(dtype: torch.dtype, max_num_seqs: int | None) -> bool:
    """Whether an engine that decodes one sequence at a time (``max_num_seqs=1``: every decode step a
    product of one row) keeps its fp32 weights plain rather than packing them: on AMD oneDNN's one-row
    kernel streams the plain layout faster than the packed one, but two rows take it longer, so only an
    engine whose steps never carry two sequences keeps it. On Intel the packed layout is the faster at one
    row and MKL takes the products of one or two rows (``few_rows_mkl``); bf16 streams half its bytes only
    when packed."""
    return max_num_seqs == 1 and dtype == torch.float32 and cpu_vendor() == "AuthenticAMD"


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


# The layers (the last part of their module name) whose weights stay plain where products of few rows go to
# MKL (``few_rows_mkl``): their batched products gain least from packing; ``gate_up_proj`` packs.
PLAIN_WITH_MKL = ("qkv_proj", "o_proj", "down_proj")


@dataclass(frozen=True)
class Gemm:
    """How the linear layers multiply (``Parts.gemm``; its contract is in docs/api.md). ``Gemm()`` is plain
    ``F.linear``; ``onednn`` goes through oneDNN's inner product on CPU tensors; ``pack`` lets a layer's
    method reorder its weight for it once; ``few_rows_mkl`` sends a product of at most ``FEW_ROWS`` rows by
    a plain weight to ``F.linear`` (MKL) instead, and keeps the ``PLAIN_WITH_MKL`` layers' weights plain for
    it. A ``Gemm`` is chosen for one dtype, the model's: ``choose`` keeps only what this machine does well."""
    onednn: bool = False
    pack: bool = False
    few_rows_mkl: bool = False

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this ``Gemm`` cannot multiply for an engine on ``device`` in ``dtype``, or None. Where it
        cannot, the engine uses this class, tplab's, instead and says why (``EngineConfig``)."""
        return None

    @classmethod
    def choose(cls, onednn: bool, pack: bool, dtype: torch.dtype = torch.float32,
               few_rows_mkl: bool = True, max_num_seqs: int | None = None) -> "Gemm":
        """What this machine can do of what was asked, for weights and activations of ``dtype``, in an engine
        of at most ``max_num_seqs`` sequences a step (None: any). MKL for few rows only beside oneDNN (without
        it every product is ``F.linear`` already), in fp32 (MKL has no fast bf16 matrix-vector product), and
        where MKL is fast (``mkl_fast_here``); no packing where one row a step is faster plain
        (``one_row_keeps_plain``)."""
        onednn = onednn and onednn_available(dtype)
        pack = onednn and pack and packing_available(dtype) and not one_row_keeps_plain(dtype, max_num_seqs)
        return cls(onednn, pack, onednn and few_rows_mkl and dtype == torch.float32 and mkl_fast_here())

    def method_for(self, prefix: str) -> "GemmMethod":
        """The method of the layer called ``prefix`` (its module name, vLLM's ``prefix``), one per layer: the
        LM head's keeps its weight and packs a copy on demand; where few rows go to MKL, the ``PLAIN_WITH_MKL``
        layers' keep theirs plain; an MoE layer's ``experts`` keep theirs plain (sliced per expert, multiplied
        by ``product``); every other layer's packs, where this ``Gemm`` packs."""
        role = prefix.rpartition(".")[2]
        if role == "lm_head":
            return LMHeadMethod(self)
        return GemmMethod(self, may_pack=role != "experts" and not (self.few_rows_mkl and role in PLAIN_WITH_MKL))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``weight`` may be a plain tensor or one from ``packed``."""
        if self.onednn and x.device.type == "cpu" and not self.mkl_takes(x, weight):
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def mkl_takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear(x, weight)`` goes to MKL as a product of few rows: at most ``FEW_ROWS`` rows
        of ``x`` by a plain (not packed) weight, where this ``Gemm`` has ``few_rows_mkl``."""
        return self.few_rows_mkl and not weight.is_mkldnn and x.numel() <= FEW_ROWS * x.shape[-1]

    def can_pack(self, weight: torch.Tensor) -> bool:
        """Whether ``packed(weight)`` packs: packing chosen, a CPU weight of a dtype oneDNN packs here."""
        return self.pack and weight.device.type == "cpu" and packing_available(weight.dtype)

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` reordered once into oneDNN's blocked layout for ``linear`` (None where it cannot be)."""
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS) if self.can_pack(weight) else None


class GemmMethod(LinearMethod):
    """One layer's products through ``gemm``. Where it packs, the layer's weight is packed at the layer's first
    ``apply`` and the plain copy dropped (``layer.weight`` becomes a parameter of the same shape and dtype on
    the ``meta`` device, as vLLM's CPU backend drops it). A layer whose own ``forward`` reads ``self.weight``
    and never calls ``apply`` keeps its weight as loaded (docs/api.md)."""

    def __init__(self, gemm: Gemm, may_pack: bool = True):
        self.gemm, self.may_pack = gemm, may_pack
        self.packs = False               # set by process_weights_after_loading
        self.packed = None               # the packed weight, made at the first apply

    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        self.packs = self.may_pack and self.gemm.can_pack(layer.weight)
        return self.packs

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.packed
        if weight is None:
            weight = self._take(layer) if self.packs else layer.weight
        return self.gemm.linear(x, weight, bias)

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, weight)

    def _take(self, layer: nn.Module) -> torch.Tensor:
        """Pack ``layer``'s weight and drop the plain one (its shape and dtype stay, on ``meta``)."""
        weight = layer.weight
        self.packed = self.gemm.packed(weight)
        layer.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
        return self.packed


class LMHeadMethod(GemmMethod):
    """The LM head's: its plain weight stays (usually the embedding's too, and the lookup needs it). Where the
    ``Gemm`` packs, a packed copy is made at the first product that wants it, as vLLM's CPU backend does:
    every product but fp32 ones of at most ``FEW_ROWS`` rows, which stream faster from the plain weight
    (through MKL where the ``Gemm`` has ``few_rows_mkl``), so a lone sequence's fp32 decode never makes it."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if self.packs and (x.shape[0] > FEW_ROWS or weight.dtype != torch.float32):
            if self.packed is None:
                self.packed = self.gemm.packed(weight)
            weight = self.packed
        return self.gemm.linear(x, weight, bias)
