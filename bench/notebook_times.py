"""Each notebook's run time now, beside the time README.md and docs/workshop.md quote for it.

    .venv/bin/python bench/notebook_times.py                  # every notebook, as committed
    .venv/bin/python bench/notebook_times.py --solutions 03   # solution mode (TPLAB_SOLUTIONS=1), notebook 03
    .venv/bin/python bench/notebook_times.py --nbval 01 03    # the exact command the quoted times were taken with
    .venv/bin/python bench/notebook_times.py --memory 06      # and the peak memory of the kernel and its ranks

The quoted times live in one place, ``bench/notebook_times.json`` (README.md and docs/workshop.md show them,
``tests/test_notebook_times.py`` checks that they agree, ``scripts/doctor.py`` scales them to a room's
machine). This script measures them again: each notebook in a fresh kernel through nbclient (a Run All,
without pytest's own start), or with ``--nbval`` as the quoted numbers were taken (pytest + nbval, one
notebook per run, start included). It prints measured, quoted and their ratio, the CPU, and the load
average before and after. On a shared machine one run moves by a factor of two either way: re-measure
on a quiet machine, a few times, before changing the JSON; no test asserts a time.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = Path(__file__).resolve().parent / "notebook_times.json"
NBVAL = ["--nbval-lax", "--nbval-sanitize-with", "nbval_sanitize.cfg", "--nbval-cell-timeout", "300"]


def claims() -> dict:
    """``bench/notebook_times.json``: notebook name -> {"committed": s, "solutions": s}, and the machine."""
    return json.loads(CLAIMS.read_text())


def run_nbclient(path: Path, timeout: float = 600) -> float:
    """Seconds to execute ``path`` in a fresh kernel started in notebooks/ (the kernel inherits the env)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def run_nbval(path: Path) -> float:
    """Seconds of ``pytest --nbval-lax`` on ``path`` alone, as docs/workshop.md's command runs it."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NBVAL, str(path)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def with_peak_memory(run, path: Path) -> tuple[float, float]:
    """``run(path)``'s seconds, and the peak GiB of every process it started (the kernel, its ranks), sampled
    every 0.2 s: the sum of their proportional set sizes, in which a page that n processes share (forked
    ranks share most of theirs) counts 1/n in each."""
    import threading

    import psutil
    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            total = 0
            for proc in me.children(recursive=True):
                try:
                    total += proc.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak[0] = max(peak[0], total)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        seconds = run(path)
    finally:
        done.set()
        sampler.join()
    return seconds, peak[0] / 2**30


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def table(measured: dict, quoted: dict, column: str) -> list[str]:
    """One line per notebook: measured s, quoted s (``column`` of the JSON), measured / quoted; then the total."""
    lines = []
    for name, seconds in measured.items():
        q = quoted[name][column]
        lines.append(f"{name:<26} {seconds:6.1f} s   quoted {q:4d} s   {seconds / q:5.2f}x")
    total, total_q = sum(measured.values()), sum(quoted[n][column] for n in measured)
    lines.append(f"{'all of these':<26} {total:6.1f} s   quoted {total_q:4d} s   {total / total_q:5.2f}x")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="notebook number prefixes (00 ... 07); default: every notebook")
    parser.add_argument("--solutions", action="store_true", help="solution mode: TPLAB_SOLUTIONS=1")
    parser.add_argument("--nbval", action="store_true", help="time pytest + nbval per notebook, start included")
    parser.add_argument("--memory", action="store_true", help="also the peak memory of the kernel and its ranks")
    args = parser.parse_args(argv)
    quoted = claims()["notebooks"]
    names = [n for n in quoted if not args.only or n[:2] in args.only]
    os.environ["TPLAB_SOLUTIONS"] = "1" if args.solutions else "0"
    run = run_nbval if args.nbval else run_nbclient
    load_before = os.getloadavg()
    measured = {}
    for name in names:
        if args.memory:
            measured[name], gib = with_peak_memory(run, ROOT / "notebooks" / f"{name}.ipynb")
            print(f"{name}: peak memory {gib:.2f} GiB (the kernel and its ranks, proportional set sizes)", flush=True)
        else:
            measured[name] = run(ROOT / "notebooks" / f"{name}.ipynb")
        print(f"{name}: {measured[name]:.1f} s", file=sys.stderr, flush=True)
    column = "solutions" if args.solutions else "committed"
    print(f"# {column}, {'pytest + nbval' if args.nbval else 'nbclient, fresh kernel'}; {cpu_model()}, "
          f"{len(os.sched_getaffinity(0))} cores; load average {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(f"# quoted: {claims()['measured_on']}")
    print("\n".join(table(measured, quoted, column)))


if __name__ == "__main__":
    main()
