"""How a linear layer multiplies on CPU: oneDNN's inner product, and weights packed for it once after
loading (vLLM's "process weights after loading").

Why oneDNN: torch's default CPU path (MKL) streams fp32 weights at about half the memory bandwidth for
the few rows of a decode step, and decode is nothing but streaming weights (bench/ measures it). Same
maths; the summation order differs at the 1e-7 level. Why packing: a matmul over the 16 rows of a batch
of decodes runs about 1.5x faster on a weight reordered into oneDNN's blocked layout, a prefill's about
10% faster, and a bf16 weight streams half the bytes of fp32 only when packed (on a plain one oneDNN
reorders it on every call). The price: a single sequence's fp32 decode (one row) runs about 10% slower
than on the plain layout (bench/, README); on AMD 1.25x slower, so there an engine of one sequence at a
time keeps its weights plain (``one_row_keeps_plain``).

Why MKL for a step of one or two rows, on Intel: there MKL's matrix-vector product streams a plain fp32
weight faster than either oneDNN layout (on a 2-core Xeon, 4.6 against 6.0 ms for 24 ``o_proj`` weights of
Qwen2.5-0.5B, 19 against 25 for ``down_proj``, 5.8 against 7.6 for ``qkv_proj``). So where ``Gemm`` has
``few_rows_mkl``, the layers whose batched products gain least from packing (``qkv_proj``, ``o_proj``,
``down_proj``: ``GemmLayer.plain_with_mkl``) keep the plain layout, and multiply on oneDNN's plain
kernel from ``FEW_ROWS + 1`` rows up; ``gate_up_proj`` packs (at 16 rows it takes 76 ms packed
against 86 plain), and the LM head streams its plain weight for a few rows as before. On that Xeon, in
fresh processes taking turns, a lone sequence's decode step took 110-123 ms against 124-137 (1.05-1.13x
faster), and a step of 16 sequences 220-241 against 215-224 ms (5% slower in the middle; the call 3%).
On AMD MKL takes a generic path at about half oneDNN's bandwidth (README), so there nothing changes
(``mkl_fast_here``). With vLLM's attention kernel and the compiled path a 16-row step is shorter and the
plain layouts cost it about 10%, so an engine that batches many sequences sets ``few_rows_mkl=False`` (README).

A layer says what it does with this by being a ``GemmLayer``: the engine calls its
``process_weights_after_loading(gemm)`` once, after the checkpoint is loaded, with the ``Gemm`` the
config chose (``EngineConfig.onednn``, ``pack_weights``, ``few_rows_mkl``). A part that is not a
``GemmLayer`` is left as it is and multiplies however its own ``forward`` does.
"""
import functools
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The row count oneDNN is told to pack a weight for. It picks the layout from it: here 4 and 16 give
# the same blocked layout (AB16b64a), 1 gives the plain one (no faster at 16 rows).
PACK_FOR_ROWS = 4
# Products of at most this many rows (a decode step of one or two sequences) are what MKL's matrix-vector
# kernel wins, where ``few_rows_mkl``; from 4 rows up oneDNN's kernels are faster on every layer (bench/).
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
    the CPU is Intel's. On AMD MKL takes a generic path, at about half the bandwidth oneDNN reaches (README)."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def one_row_keeps_plain(dtype: torch.dtype, max_num_seqs: int) -> bool:
    """Whether an engine that decodes one sequence at a time (``max_num_seqs=1``: every decode step a
    product of one row) keeps its fp32 weights plain rather than packing them. On AMD oneDNN's one-row
    kernel streams the plain layout about 1.25x faster than the packed one (a Qwen2.5-0.5B step's weights,
    2 cores of an AMD EPYC Zen 3: 125-128 against 157-163 ms), but two rows take it 1.4x longer than packed
    (230 against 168 ms), so only an engine whose steps never carry two sequences keeps it. On Intel the
    packed layout is the faster of the two at one row (81 against 87 ms), and MKL takes the products of
    one or two rows (``few_rows_mkl``); bf16 streams half its bytes only when packed."""
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


@dataclass(frozen=True)
class Gemm:
    """How ``linear`` multiplies: ``Gemm()`` is plain ``F.linear``; ``onednn`` goes through oneDNN's inner
    product on CPU tensors; ``pack`` lets a layer reorder its weight for it once after loading;
    ``few_rows_mkl`` sends a product of at most ``FEW_ROWS`` rows by a plain weight to ``F.linear`` (MKL)
    instead, and keeps the weights of ``plain_with_mkl`` layers plain for it. A ``Gemm`` is chosen for one
    dtype, the model's: ``choose`` keeps only what this machine does in that dtype, and does well.

    Contract of ``Parts.gemm`` (what a replacement keeps; ``tplab.layers.vllm_gemm.VllmCpuGemm`` is one):
    - ``choose(onednn, pack, dtype, few_rows_mkl) -> Gemm``: the instance every ``GemmLayer`` adopts after
      loading (``pack`` False: every weight must stay readable, as ``probe.load_model`` needs);
    - ``can_pack(weight)``, ``packed(weight)``: whether a weight is replaced, and by what; ``linear(x,
      weight, bias)`` takes a plain weight or what ``packed`` made; ``keeps_plain(layer)``;
    - ``cannot_run(device, dtype)``: why it cannot run there, or None (tplab's runs everywhere)."""
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
               few_rows_mkl: bool = True) -> "Gemm":
        """What this machine can do of what was asked, for weights and activations of ``dtype``. MKL for few
        rows only beside oneDNN (without it every product is ``F.linear`` already), in fp32 (MKL has no fast
        bf16 matrix-vector product), and where MKL is fast (``mkl_fast_here``)."""
        onednn = onednn and onednn_available(dtype)
        return cls(onednn, onednn and pack and packing_available(dtype),
                   onednn and few_rows_mkl and dtype == torch.float32 and mkl_fast_here())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``weight`` may be a plain tensor or one from ``packed``."""
        if self.onednn and x.device.type == "cpu" and not self.mkl_takes(x, weight):
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def mkl_takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear(x, weight)`` goes to MKL as a product of few rows: at most ``FEW_ROWS`` rows
        of ``x`` by a plain (not packed) weight, where this ``Gemm`` has ``few_rows_mkl``."""
        return self.few_rows_mkl and not weight.is_mkldnn and x.numel() <= FEW_ROWS * x.shape[-1]

    def keeps_plain(self, layer: "GemmLayer") -> bool:
        """Whether ``layer``'s weight stays plain for MKL's few-row products instead of being packed."""
        return self.few_rows_mkl and layer.plain_with_mkl

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
    # where the Gemm sends few-row products to MKL (``few_rows_mkl``), keep this layer's weight plain for
    # them: set on the layers whose products of 16 rows gain little from packing (qkv, o_proj, down_proj)
    plain_with_mkl = False

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
