"""Where a benchmark's results go: ``bench/results/<machine>/``, one folder per machine, named from its GPU or
CPU (``machine_folder``), so that results of different machines are never mixed. docs/performance.md quotes
them, each beside its machine.
"""
import os
import platform
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def machine_folder(m: dict | None = None) -> str:
    """The short name of this machine, the folder under ``bench/results/`` its runs land in: the GPU's
    (``h200``), else the CPU's (``xeon``, ``epyc-zen3``, ``epyc-zen4``; AMD's generation read from the cpu
    family and AVX-512). ``TPLAB_BENCH_MACHINE`` names it instead."""
    if os.environ.get("TPLAB_BENCH_MACHINE"):
        return os.environ["TPLAB_BENCH_MACHINE"]
    if m is None:
        from common import machine_info
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
