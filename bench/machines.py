"""What a result was measured on (``machine_info``, stored beside it) and where a benchmark's results go:
``bench/results/<machine>/``, one folder per machine, named from its GPU or CPU (``machine_folder``), so that
results of different machines are never mixed. docs/performance.md quotes them, each beside its machine.
"""
import os
import platform
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent


def machine_folder(m: dict | None = None) -> str:
    """The short name of this machine, the folder under ``bench/results/`` its runs land in: the GPU's
    (``h200``), else the CPU's (``xeon``, ``epyc-zen3``, ``epyc-zen4``; AMD's generation read from the cpu
    family and AVX-512). ``TPLAB_BENCH_MACHINE`` names it instead."""
    if os.environ.get("TPLAB_BENCH_MACHINE"):
        return os.environ["TPLAB_BENCH_MACHINE"]
    if m is None:
        m = machine_info()
    slug = lambda text: "-".join(w for w in "".join(c if c.isalnum() else " " for c in text.lower()).split()
                                 if w not in ("nvidia", "geforce", "intel", "amd", "r", "tm", "processor", "cpu"))
    if m.get("gpu"):
        return slug(m["gpu"]) or "gpu"
    cpu = m.get("cpu_model", "").lower()
    if "xeon" in cpu or "epyc" in cpu or "ryzen" in cpu:
        name = next(n for n in ("xeon", "epyc", "ryzen") if n in cpu)
    else:
        name = slug(cpu).split("-")[0] or platform.machine().lower() or "cpu"
    if m.get("cpu_vendor") == "AuthenticAMD":
        family = _cpu_family()
        zen = {23: "zen2", 26: "zen5"}.get(family) or (("zen4" if "avx512f" in m.get("cpu_flags", []) else "zen3")
                                                      if family == 25 else None)
        name += f"-{zen}" if zen else ""
    return name


def _cpu_family() -> int | None:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("cpu family"))
        return int(line.partition(":")[2])
    except (OSError, StopIteration, ValueError):
        return None


def results_path(name: str, quick: bool = False) -> Path:
    """``bench/results/<machine>/<name>`` (``--quick``: ``bench/results/quick/<name>``), its folder made."""
    path = BENCH_DIR / "results" / ("quick" if quick else machine_folder()) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_fp16")


def _cpuinfo() -> tuple[str, str, list[str]]:
    """(model name, vendor, the KERNEL_FLAGS this CPU has) from /proc/cpuinfo (Linux), else platform's."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return (fields.get("model name") or platform.processor() or "unknown", fields.get("vendor_id", platform.machine()),
            [f for f in KERNEL_FLAGS if f in flags])


def machine_info() -> dict:
    """What a result was measured on, stored beside it: results from different machines are not mixed."""
    import psutil
    import transformers
    cpu, vendor, flags = _cpuinfo()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu_model": cpu, "cpu_vendor": vendor, "cpu_flags": flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "gpu": gpu,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "logical_cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "load_average_at_start": os.getloadavg()}


def machine() -> str:
    """One line naming the machine, for the head of every printed table."""
    m = machine_info()
    return (f"{m['cpu_model']} ({m['cpu_vendor']}), {m['cores']} cores, flags {' '.join(m['cpu_flags']) or '-'}, "
            f"torch {m['torch']} ({m['torch_cpu_capability']} kernels)" + (f", GPU {m['gpu']}" if m["gpu"] else ""))


def same_machine(a: dict, b: dict) -> bool:
    """Whether two results' ``machine_info`` name the same kind of machine (CPU, cores, flags, GPU)."""
    return all(a.get(k) == b.get(k) for k in ("cpu_model", "cores", "cpu_flags", "gpu"))
