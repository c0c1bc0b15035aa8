"""Small conveniences every notebook uses: one place to pick the model, a deterministic setup,
a ledger of checks that the last cell asserts, and instruments for watching the engine run."""
import contextlib
import json
import os
import platform
import random
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tplab.distributed.launcher import pick_backend
from tplab.engine.config import env_flag
from tplab.exercises import cells as exercise_cells
from tplab.exercises.cells import your_parts  # noqa: F401  (notebook 06's finale)


def model_dir() -> Path:
    """The model every notebook runs: ``$TPLAB_MODEL`` (a local HF folder, e.g. Qwen2.5-0.5B-Instruct)
    when set, else the shipped tiny model."""
    from tplab.models import tiny_stories
    chosen = os.environ.get("TPLAB_MODEL")
    return Path(chosen).expanduser() if chosen else tiny_stories()


def setup(seed: int = 0, solutions: bool | None = None) -> None:
    """Seed Python's and torch's random numbers, keep library progress bars and warnings out of cell outputs,
    and watch the exercise cells (``# Exercise: <name>``). ``solutions=True`` (default: ``$TPLAB_SOLUTIONS``, 1 or
    0 as tplab's other switches) makes every exercise cell run its reference solution, so a room can skip ahead."""
    if solutions is None:
        solutions = env_flag("TPLAB_SOLUTIONS", "0")
    if not isinstance(solutions, bool):
        raise ValueError(f"solutions must be True, False or None (from $TPLAB_SOLUTIONS), got {solutions!r}")
    exercise_cells.install(solutions)
    if solutions:
        print("solution mode: every `# Exercise:` cell runs its reference solution")
    random.seed(seed)
    torch.manual_seed(seed)
    # for tplab's own offline check and the ranks it starts; an HF library imported already has read it (it is
    # workbook.sh that sets it before Python starts)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    torch.set_printoptions(precision=4, sci_mode=False)


def ops_of(fn) -> set[str]:
    """The names of the aten ops ``fn()`` runs, from PyTorch's profiler (whose C++ side would log to the
    notebook's stderr: it is sent to /dev/null while it runs)."""
    from torch.profiler import profile
    quiet, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    os.dup2(quiet, 2)
    try:
        with profile() as prof:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)
    return {e.name for e in prof.events()}


@contextlib.contextmanager
def watch(obj, method: str, record):
    """While on, every call of ``obj.<method>`` runs as before, and then appends ``record(result, *args)`` to the
    list it yields: what a cell wants to see of each call, taken as it returns (the engine may change the
    arguments later). ``obj`` gets its own method back when the block ends, even on an error."""
    original, own = getattr(obj, method), method in vars(obj)
    seen = []

    def watched(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(record(result, *args, **kwargs))
        return result

    setattr(obj, method, watched)
    try:
        yield seen
    finally:
        if own:
            setattr(obj, method, original)
        else:
            delattr(obj, method)


class PeakBytes(TorchDispatchMode):
    """While on (``with PeakBytes() as peak``): ``peak.peak``, the most bytes that tensors made by ops held at
    once. A dispatch mode sees every op's outputs; a weak reference to each new storage says when it is freed.
    Views and in-place results make no new storage; what a kernel allocates inside itself is not seen."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0          # storage -> bytes, their sum now, its largest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for gone in [ref for ref in self.live if ref.expired()]:          # freed since the last op
            self.now -= self.live.pop(gone)
        inputs = {_storage(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            ref = _storage(t)
            if ref is not None and ref not in inputs and ref not in self.live:
                self.live[ref] = t.untyped_storage().nbytes()
                self.now += self.live[ref]
        self.peak = max(self.peak, self.now)
        return out


def _storage(t) -> StorageWeakRef | None:
    """A weak reference to a plain tensor's storage; None for anything else (a packed weight has none to see)."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_mkldnn:
        return StorageWeakRef(t.untyped_storage())
    return None


def _bench_rows(data) -> list[dict]:
    """The result rows (dicts with a positive "ratio"), wherever a results file keeps them."""
    if isinstance(data, dict):
        return _bench_rows(data["rows"]) if "rows" in data else [r for v in data.values() for r in _bench_rows(v)]
    if isinstance(data, list):
        return [d for d in data if isinstance(d, dict) and isinstance(d.get("ratio"), (int, float)) and d["ratio"] > 0]
    return []


def _better(row: dict) -> str:
    """Which way the ratio should go: the target says so, else the unit (rates up; time and memory down)."""
    target = str(row.get("target") or "")
    if target.startswith((">", "<")):
        return "higher" if target.startswith(">") else "lower"
    unit = str(row.get("unit", ""))
    return "higher" if unit.endswith("/s") or unit == "fraction" else "lower"


def show_bench_results() -> None:
    """Print the newest ``bench/results/<machine>/run_all.json`` (``bench/run_all.py`` writes it) as a table: each
    row's tplab and reference figures, their ratio, which way is better, its target, and the machine; or say why
    there is none."""
    runs = sorted((p for p in (Path(__file__).resolve().parents[1] / "bench" / "results").glob("*/run_all.json")
                   if p.parent.name != "quick"), key=lambda p: p.stat().st_mtime)   # not run_all.py --quick's
    if not runs:
        print("no benchmark results to show (no bench/results/<machine>/run_all.json); run bench/run_all.py to make one")
        return
    try:
        data = json.loads(runs[-1].read_text())
    except (OSError, ValueError) as e:
        print(f"no benchmark results to show (cannot read {runs[-1]}: {type(e).__name__})")
        return
    rows, machine = _bench_rows(data), data.get("machine", {})
    if not rows:
        print(f"no benchmark results to show ({runs[-1].name} has no rows with a ratio)")
        return
    print(f"measured on {machine.get('cpu_model', 'an unrecorded CPU')}, {machine.get('cores', '?')} cores, "
          f"torch {machine.get('torch', '?')}\n")
    print(f"{'measurement':<58} | {'tplab':>9} | {'reference':>9} | {'unit':<8} | {'ratio':>6} | better | target")
    for r in rows:
        met = {True: "met", False: "MISSED"}.get(r.get("met"), "")
        print(f"{r.get('name', '?').strip()[:58]:<58} | {r.get('tplab', float('nan')):9.4g} | "
              f"{r.get('reference', float('nan')):9.4g} | {r.get('unit', ''):<8} | {r['ratio']:6.3g} | "
              f"{_better(r):<6} | {r.get('target') or '-'} {met}")


def machine() -> str:
    """This machine as a measurement should name it: the CPU's model (Linux's /proc/cpuinfo, else platform's)
    and the cores this process may run on."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{names[0] if names else platform.processor() or 'an unrecorded CPU'}, {cores} cores"


def backend_for(world_size: int) -> str:
    """The backend ``tplab.launch`` picks for ``world_size`` ranks here: NCCL with a GPU per rank, else gloo."""
    return pick_backend(world_size)


class Checks:
    """Every claim a notebook proves, recorded as it goes; ``assert_all()`` in the last cell.

    ``checks("name", condition, "detail")`` prints ``name | detail | ok`` (or FAIL) and
    asserts at once, so a broken claim stops the notebook where it is made.
    """

    def __init__(self):
        self.results: dict[str, bool] = {}

    def __call__(self, name: str, ok, detail: str = "") -> None:
        # Returns None, so a cell ending in a check shows the check line and nothing else.
        ok = bool(ok)
        self.results[name] = ok
        print(f"{name} | {detail + ' | ' if detail else ''}{'ok' if ok else 'FAIL'}")
        assert ok, f"check failed: {name} {detail}"

    def exercise(self, result) -> None:
        """Show an exercise checker's result. A wrong answer is feedback, not a failure, except in
        solution mode, where every checker must say correct."""
        print(result)
        if exercise_cells.solution_mode():
            self(f"solution: {result.name}", result.ok is True, "the reference solution passes")

    def assert_all(self) -> None:
        failed = [n for n, ok in self.results.items() if not ok]   # a cell that failed, then was skipped past
        assert self.results and not failed, f"failed checks: {failed}"
        print(f"all {len(self.results)} checks held")
