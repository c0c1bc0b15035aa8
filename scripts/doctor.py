"""Pre-flight for a workshop room: ``./workbook.sh doctor``.

Checks Python, the torch build (CPU or CUDA), cores, memory, shared memory and GPUs, the kernel the
notebooks open with, then starts two ranks and generates a few tokens with the shipped tiny model.
From that run's time it estimates each notebook's run time on this machine and names the slow ones.
Exits non-zero when something must be fixed, and says how.

It imports torch and tplab only inside the checks, so a broken install is reported, not raised.
"""
from __future__ import annotations     # an old Python must reach check_python, not fail on the annotations

import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30

# Measured on the workbook's reference machine (bench/notebook_times.json says which; README.md and
# docs/workshop.md quote the same file): each notebook's nbval run in a fresh kernel, one notebook at a
# time (as committed), and this script's two-rank run beside each (median). Estimates for another machine
# scale by the ratio of its two-rank run to this one.
_TIMES = json.loads((ROOT / "bench" / "notebook_times.json").read_text())
REFERENCE_RANKS_SECONDS = _TIMES["ranks_seconds"]
REFERENCE_NOTEBOOK_SECONDS = {name: t["committed"] for name, t in _TIMES["notebooks"].items()}
SLOW_SECONDS = 120            # a notebook a room waits on longer than this gets named
# Notebook 06 at its peak, kernel and ranks: 1.25 GiB PSS (bench/notebook_times.py --memory 06); JupyterLab beside it
NEED_MEMORY, WANT_MEMORY = int(2.5 * GiB), 4 * GiB
KERNEL_DISPLAY_NAME = "Python 3 (ipykernel)"     # what the notebooks' metadata says; JupyterLab rewrites it otherwise


@dataclass
class Check:
    status: str          # "ok", "warn" or "FAIL"
    name: str
    detail: str
    fix: str = ""


def check_python(version=sys.version_info) -> Check:
    found = ".".join(map(str, version[:3]))
    if tuple(version[:2]) < (3, 10):
        return Check("FAIL", "python", f"Python {found}",
                     "install Python 3.11 (3.10 or newer), then `rm -rf .venv` and run ./workbook.sh doctor again")
    return Check("ok", "python", f"Python {found}" + ("" if tuple(version[:2]) == (3, 11) else " (tested on 3.11)"))


def torch_facts() -> dict:
    """What the installed torch is: version, CUDA build, visible GPUs; or the import error."""
    try:
        import torch
    except Exception as e:                      # a broken install must be reported, not raised
        return {"error": f"{type(e).__name__}: {e}"}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{p.name} ({p.total_memory / GiB:.0f} GiB)")
    return {"version": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
            "nccl": bool(gpus) and torch.distributed.is_nccl_available()}


def check_torch(facts: dict, system: str = platform.system()) -> list[Check]:
    if "error" in facts:
        return [Check("FAIL", "torch", f"cannot import torch: {facts['error']}",
                      "reinstall: `rm -rf .venv` and run ./workbook.sh doctor again")]
    build = f"CUDA {facts['cuda']} build" if facts["cuda"] else "CPU build"
    checks = [Check("ok", "torch", f"torch {facts['version']}, {build}")]
    if not facts["version"].startswith("2.13.0"):
        checks[0] = Check("warn", "torch", f"torch {facts['version']}, {build} (the workbook pins 2.13.0)",
                          "`rm -rf .venv` and run ./workbook.sh doctor again to get the pinned torch")
    gpus = facts["gpus"]
    if gpus:
        how = "TP 2 runs on NCCL" if len(gpus) >= 2 and facts["nccl"] else "TP > 1 runs on gloo (CPU): NCCL needs a GPU per rank"
        checks.append(Check("ok", "gpus", f"{len(gpus)}: {', '.join(gpus)}; {how}"))
    elif facts["cuda"] and system == "Linux":
        checks.append(Check("warn", "gpus", "none visible, but torch is the CUDA build (several GB of CUDA libraries)",
                            "on a laptop without a GPU: `rm -rf .venv`, then TPLAB_TORCH_INDEX="
                            "https://download.pytorch.org/whl/cpu ./workbook.sh doctor"))
    else:
        checks.append(Check("ok", "gpus", "none: every rank runs on the CPU over gloo, as the notebooks expect"))
    return checks


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_cores(cores: int) -> Check:
    if cores < 2:
        return Check("warn", "cores", f"{cores} usable core: two ranks take turns on it, so every TP cell is slow",
                     "give the machine (or container) at least 2 cores")
    return Check("ok", "cores", f"{cores} usable")


def check_memory(available: int) -> Check:
    detail = f"{available / GiB:.1f} GiB available"
    if available < NEED_MEMORY:
        return Check("FAIL", "memory", detail + f"; notebook 06 and JupyterLab need {NEED_MEMORY / GiB:.1f} GiB",
                     "close other programs, or give the machine more memory")
    if available < WANT_MEMORY:
        return Check("warn", "memory", detail + "; enough, but close other programs during notebook 06")
    return Check("ok", "memory", detail)


def check_shared_memory(path: str = "/dev/shm", system: str = platform.system()) -> Check:
    """Ranks on one host exchange tensors through files in /dev/shm; Docker gives it 64 MB by default."""
    if system != "Linux":
        return Check("ok", "shared memory", f"not needed on {system}")
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        return Check("FAIL", "shared memory", f"{path} is missing or not writable",
                     "mount a tmpfs at /dev/shm (Docker: --shm-size=1g), or set TPLAB_SHM_COMM=0")
    free = shutil.disk_usage(path).free
    if free < 256 << 20:
        return Check("warn", "shared memory", f"{free >> 20} MiB free in {path}",
                     "Docker: run with --shm-size=1g (ranks and the real-size benchmarks need more)")
    return Check("ok", "shared memory", f"{free / GiB:.1f} GiB free in {path}")


def check_kernel() -> Check:
    """The lab opens the notebooks with the ``python3`` kernel; it must be this environment's."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
        spec = KernelSpecManager().get_kernel_spec("python3")
    except Exception as e:
        return Check("FAIL", "kernel", f"no python3 kernel: {e}", "`rm -rf .venv` and run ./workbook.sh doctor again")
    if not Path(spec.resource_dir).resolve().is_relative_to(Path(sys.prefix).resolve()):
        return Check("warn", "kernel", f"python3 is {spec.resource_dir}, outside this environment",
                     "remove it (`jupyter kernelspec remove python3` outside .venv) so notebooks run here")
    if spec.display_name != KERNEL_DISPLAY_NAME:
        return Check("warn", "kernel", f"python3 is named {spec.display_name!r}: the lab marks notebooks modified")
    return Check("ok", "kernel", f"python3 ({spec.display_name}) in this environment")


def check_saved_python(notebooks=None, version: str = platform.python_version()) -> Check:
    """JupyterLab records the kernel's Python version in a notebook it opens: a different version
    marks every notebook modified (harmless: close without saving)."""
    saved = {json.loads(p.read_text()).get("metadata", {}).get("language_info", {}).get("version")
             for p in (notebooks if notebooks is not None else sorted((ROOT / "notebooks").glob("*.ipynb")))}
    saved.discard(None)
    if saved and saved != {version}:
        return Check("warn", "notebooks' Python", f"saved with Python {', '.join(sorted(saved))}, this is {version}: "
                     "the lab marks each notebook modified as it opens", "close them without saving, or "
                     "`git checkout notebooks/` to drop the changed version line")
    return Check("ok", "notebooks' Python", f"saved with Python {version}, as here")


GEMM_EPS_LIMIT = 64   # float32 eps of the output's largest value; a float32 GEMM here measures 3-7 (AMD EPYC, Zen 4)


def gemm_paths() -> dict:
    """The float32 matrix products the workbook compares: HF's (``F.linear``) and tplab's (oneDNN, with the
    weight packed, where this machine has it: ``tplab.kernels.gemm``)."""
    import torch.nn.functional as F
    from tplab.kernels.gemm import Gemm
    paths = {"F.linear (HF)": F.linear}
    gemm = Gemm.choose(onednn=True, pack=True)
    if gemm.onednn:
        paths["oneDNN packed (tplab)" if gemm.pack else "oneDNN (tplab)"] = \
            lambda x, w: gemm.linear(x, gemm.packed(w) if gemm.pack else w)
    return paths


def check_float32_gemm(paths=None) -> Check:
    """Each float32 GEMM path against float64 at a Qwen2.5-0.5B shape, in float32 eps of the largest output:
    a path that rounds its inputs to bf16/tf32/fp16 (an fpmath mode, a reduced matmul precision) is thousands
    of eps off, and would put tplab and HF further apart than rounding on this machine."""
    import torch
    paths = gemm_paths() if paths is None else paths
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 896, generator=gen), torch.randn(4864, 896, generator=gen) / 30
    ref = (x.double() @ w.double().T)
    eps = {name: ((f(x, w).double() - ref).abs().max() / ref.abs().max()).item() / torch.finfo(torch.float32).eps
           for name, f in paths.items()}
    detail = ", ".join(f"{name} {e:.0f} eps" for name, e in eps.items())
    bad = [name for name, e in eps.items() if e > GEMM_EPS_LIMIT]
    if bad:
        return Check("warn", "float32 GEMM", f"{detail}: {', '.join(bad)} is not float32 (over {GEMM_EPS_LIMIT} eps)",
                     "tplab and HF will differ by more than rounding here: unset ONEDNN_DEFAULT_FPMATH_MODE, keep "
                     "torch.set_float32_matmul_precision('highest'), or run with TPLAB_ONEDNN=0")
    return Check("ok", "float32 GEMM", f"{detail} against float64 (float32: under {GEMM_EPS_LIMIT})")


def check_fp32_kernels(gemm=None) -> Check:
    """Which kernels an fp32 engine's linear layers run on here (``Gemm.choose``, as the engine picks them)."""
    if gemm is None:
        from tplab.kernels.gemm import Gemm
        gemm = Gemm.choose(onednn=True, pack=True)
    if not gemm.onednn:
        return Check("ok", "fp32 kernels", "F.linear, as HF's: this torch has no oneDNN inner product here")
    batches = "oneDNN with packed weights" if gemm.pack else "oneDNN"
    if gemm.few_rows_mkl:
        packed = ", gate_up_proj and the LM head packed" if gemm.pack else ""
        return Check("ok", "fp32 kernels", f"one or two rows (a lone sequence's decode): MKL on plain weights, "
                     f"faster on Intel; more rows: oneDNN{packed} (TPLAB_FEW_ROWS_MKL=0: {batches} always)")
    return Check("ok", "fp32 kernels", f"{batches} at every batch size (MKL's few-row path is for Intel CPUs)")


def check_bf16_kernels(onednn_bf16: bool | None = None) -> Check:
    """Whether oneDNN multiplies bf16 on this CPU (it needs AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU has
    neither). Without it a bf16 engine's linear layers run on ``F.linear``, as HF's do: correct, but little faster
    than float32 for one sequence (measured on an AVX2 AMD EPYC, Zen 3) and several times slower for a batch."""
    if onednn_bf16 is None:
        import torch
        from tplab.kernels.gemm import packing_available
        onednn_bf16 = packing_available(torch.bfloat16)
    if onednn_bf16:
        return Check("ok", "bf16 kernels", "oneDNN bf16 with packed weights: dtype='bfloat16' streams half fp32's bytes")
    return Check("ok", "bf16 kernels", "none in oneDNN on this CPU (they need AVX-512 or AVX-NE-CONVERT): "
                 "dtype='bfloat16' runs on F.linear, little faster than float32 here and slower for batches; "
                 "the notebooks run float32")


def run_two_ranks() -> float:
    """Start the shipped tiny model at TP 2, generate 8 greedy tokens, check them against TP 1.
    Returns the seconds it took, ranks' start included."""
    from tplab import LLM, SamplingParams, models
    prompt, params = "Once upon a time", SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(models.tiny_stories()) as llm:
        want = llm.generate([prompt], params)[0].token_ids
    start = time.perf_counter()
    with LLM(models.tiny_stories(), tensor_parallel_size=2, timeout=120) as llm:
        got = llm.generate([prompt], params)[0].token_ids
    seconds = time.perf_counter() - start
    if got != want:
        raise AssertionError(f"TP 2 generated {got}, TP 1 {want}")
    return seconds


def check_ranks(run=run_two_ranks) -> tuple[Check, float | None]:
    try:
        seconds = run()
    except Exception as e:
        return Check("FAIL", "two ranks", f"{type(e).__name__}: {str(e)[:400]}",
                     "the message above names the cause; a firewall that blocks 127.0.0.1 ports stops gloo"), None
    return Check("ok", "two ranks", f"TP 2 started and generated 8 tokens equal to TP 1 in {seconds:.1f} s"), seconds


def slow_notebooks(seconds: float | None, reference=REFERENCE_NOTEBOOK_SECONDS) -> list[Check]:
    """Each notebook's estimated run time here: its measured time scaled by this machine's two-rank run."""
    if seconds is None:
        return []
    scale = seconds / REFERENCE_RANKS_SECONDS
    estimates = {name: t * scale for name, t in reference.items()}
    slow = {n: t for n, t in estimates.items() if t > SLOW_SECONDS}
    listing = ", ".join(f"{n[:2]} ~{t:.0f} s" for n, t in estimates.items())
    if slow:
        names = ", ".join(f"{n} (~{t / 60:.1f} min)" for n, t in slow.items())
        return [Check("warn", "notebooks", f"{scale:.1f}x the reference machine: {listing}",
                      f"slow here: {names}; run them before the session, or demo them (docs/workshop.md)")]
    return [Check("ok", "notebooks", f"{scale:.1f}x the reference machine: {listing}")]


def gather() -> list[Check]:
    """Every check on this machine, in the order a room would fix them."""
    checks = [check_python()]
    facts = torch_facts()
    checks += check_torch(facts)
    checks += [check_cores(usable_cores())]
    try:
        import psutil
        checks.append(check_memory(psutil.virtual_memory().available))
    except ImportError:
        checks.append(Check("FAIL", "memory", "psutil is missing", "`rm -rf .venv` and run ./workbook.sh doctor again"))
    checks += [check_shared_memory(), check_kernel(), check_saved_python()]
    if "error" not in facts:
        checks += [check_float32_gemm(), check_fp32_kernels(), check_bf16_kernels()]
        ranks, seconds = check_ranks()
        checks += [ranks] + slow_notebooks(seconds)
    return checks


def report(checks: list[Check], out=sys.stdout) -> int:
    """Print one line per check and every fix; 1 when any check failed."""
    for c in checks:
        print(f"{c.status:>4}  {c.name:<17} {c.detail}", file=out)
    fixes = [c for c in checks if c.fix and c.status != "ok"]
    if fixes:
        print("\nWhat to do:", file=out)
        for c in fixes:
            print(f"  {c.name}: {c.fix}", file=out)
    failed = sum(c.status == "FAIL" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    print(f"\ndoctor: {len(checks) - failed - warned} ok, {warned} warnings, {failed} problems"
          + (" - fix the problems above first" if failed else ""), file=out)
    return 1 if failed else 0


def main() -> int:
    print(f"Checking this machine for the workbook ({platform.system()} {platform.machine()}, {ROOT})...\n", flush=True)
    return report(gather())


if __name__ == "__main__":
    sys.exit(main())
