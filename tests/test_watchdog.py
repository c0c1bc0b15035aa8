"""Learner code that never returns: each looping exercise or part ends within the watchdog's bound with a
message naming its function and line, and a correct call right after it works (the process goes on)."""
import re
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch

from tplab.exercises import check_part, nb00, nb01, nb03
from tplab.exercises import watchdog
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the looping parts below travel to the ranks by value

BOUND = 3.0          # the tests' bound; the default (watchdog.BOUND_S, 30 s) is for a slow laptop
SLACK = 25.0         # starting ranks and HF's reference on a loaded 2-core machine, on top of the bound


@pytest.fixture
def short_bound(monkeypatch):
    monkeypatch.setattr(watchdog, "BOUND_S", BOUND)


def stopped_in(function: str, *lines: str, bound: float = BOUND) -> str:
    """The watchdog's words for a stop in ``function`` at one of the loop's ``lines`` (the one it was on)."""
    return (rf"did not return within {bound:g} s, stopped in {re.escape(function)} \(line \d+\): "
            rf"`({'|'.join(map(re.escape, lines))})`")


def spins(n):
    total = 0
    while n > 0:
        total += 1


def test_a_loop_is_stopped_at_the_bound_with_its_function_and_line_and_nothing_leaks_after():
    start = time.monotonic()
    with pytest.raises(watchdog.DidNotReturn, match=stopped_in("spins", "while n > 0:", "total += 1", bound=1)):
        watchdog.call_bounded(1.0, spins, 1)
    assert 1.0 <= time.monotonic() - start < 1.0 + SLACK
    with watchdog.bounded(0.2):                  # ends in time: nothing is raised, now or later
        pass
    time.sleep(0.5)
    assert watchdog.call_bounded(1.0, sum, [1, 2]) == 3


def test_a_slow_import_is_waited_for_and_a_learners_module_that_loops_is_stopped(tmp_path, monkeypatch):
    """A rank on a loaded machine may still be importing (tplab's or torch's modules) at the bound: that is not
    the learner's loop, so the watchdog waits for it; a learner's own module that loops as it loads is
    stopped, named by its line."""
    import importlib
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.5)\n")
    (tmp_path / "loops_on_import.py").write_text("while True:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(watchdog, "_NOT_YOURS", watchdog._NOT_YOURS + (str(tmp_path / "slow_to_import.py"),))
    try:
        assert watchdog.call_bounded(0.5, importlib.import_module, "slow_to_import").__name__ == "slow_to_import"
        with pytest.raises(watchdog.DidNotReturn, match=stopped_in("<module>", "while True:", "pass", bound=0.5)):
            watchdog.call_bounded(0.5, importlib.import_module, "loops_on_import")
    finally:
        for name in ("slow_to_import", "loops_on_import"):
            sys.modules.pop(name, None)


def swallows(n):
    while True:
        try:
            spins(n)
        except Exception:                       # the learner's own handler must not keep it running
            pass


def test_a_learners_except_exception_does_not_swallow_it():
    with pytest.raises(watchdog.DidNotReturn, match="stopped in spins"):
        watchdog.call_bounded(0.5, swallows, 1)


def causal_mask(q_len, k_len):
    mask = torch.ones(q_len, k_len, dtype=torch.bool)
    row = 0
    while row < q_len:
        mask[row, row + 1:] = False
    return mask


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    while half:
        x = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x


@pytest.mark.parametrize("checker, fn, lines", [
    (nb01.check_causal_mask, causal_mask, ("while row < q_len:", "mask[row, row + 1:] = False")),
    (nb03.check_apply_rope, apply_rope, ("while half:", "x = torch.cat((-x[..., half:], x[..., :half]), dim=-1)"))])
def test_a_looping_exercise_function_is_stopped_and_the_next_call_works(short_bound, checker, fn, lines):
    start = time.monotonic()
    result = checker(fn)
    assert time.monotonic() - start < BOUND + SLACK
    assert result.ok is False and re.search(f"your {fn.__name__} " + stopped_in(fn.__name__, *lines), result.message), \
        result.message
    assert checker(define(fn.__name__)[fn.__name__]).ok is True


def ring_all_reduce(x):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks, step = list(x.reshape(-1).tensor_split(world)), 0       # step is never incremented
    while step < world - 1:
        chunks[(rank - step) % world] = chunks[(rank - step) % world] * 1
    return x


def test_a_looping_ring_all_reduce_names_the_rank_and_line_and_the_next_call_works(short_bound):
    start = time.monotonic()
    result = nb00.check_ring_all_reduce(ring_all_reduce, world_sizes=(2,))
    assert time.monotonic() - start < BOUND + SLACK
    assert result.ok is False and re.search(
        r"world size 2: rank [01] " + stopped_in("ring_all_reduce", "while step < world - 1:",
                                             "chunks[(rank - step) % world] = chunks[(rank - step) % world] * 1"),
        result.message), result.message
    assert nb00.check_ring_all_reduce(define("ring_all_reduce")["ring_all_reduce"], world_sizes=(2,)).ok is True


Row, Attention = define("row_linear")["MyRowParallelLinear"], define("attention")["MyAttention"]


class SpinsOnRank0(Row):
    def forward(self, x):
        while self.tp_size > 1 and self.tp_rank == 0:
            x = x + 0
        return super().forward(x)


class LoopingAttention(Attention):
    """Loops over an iterator that never ends (iter(int, 1) never yields 1)."""
    def forward(self, q, k, v, kv_cache, meta):
        for _ in iter(int, 1):
            q = q * 1
        return super().forward(q, k, v, kv_cache, meta)


def test_a_rank_spinning_in_row_linear_is_named_not_called_a_mismatched_collective(short_bound):
    start = time.monotonic()
    result = check_part("row_linear", SpinsOnRank0)
    assert time.monotonic() - start < BOUND + SLACK
    assert result.ok is False and re.search(
        "at TP 2, rank 0 " + stopped_in("SpinsOnRank0.forward", "while self.tp_size > 1 and self.tp_rank == 0:", "x = x + 0"), result.message), result.message
    assert "did not finish in time" not in result.message
    assert check_part("row_linear", Row).ok is True


def test_a_looping_attention_part_in_this_process_is_stopped_and_the_next_call_works(short_bound):
    start = time.monotonic()
    result = check_part("attention", LoopingAttention)
    assert time.monotonic() - start < BOUND + SLACK
    assert result.ok is False and re.search(
        "at TP 1: your code " + stopped_in("LoopingAttention.forward", "for _ in iter(int, 1):",
                                         "q = q * 1"), result.message), result.message
    assert check_part("attention", Attention).ok is True


def test_a_bound_that_is_not_a_positive_number_is_refused_with_what_to_set():
    import os
    import subprocess
    for bad in ("abc", "0", "-3"):
        run = subprocess.run([sys.executable, "-c", "import tplab.exercises"], capture_output=True, text=True,
                             env={**os.environ, "TPLAB_RETURN_BOUND_S": bad})
        assert run.returncode != 0 and f"TPLAB_RETURN_BOUND_S={bad!r}: set it to the seconds" in run.stderr, run.stderr


def test_the_bound_is_under_the_ranks_timeouts():
    """The watchdog must name the stuck rank before the ranks' own timeout says only that they hung."""
    assert watchdog.bound_for(90.0) < 90.0 and watchdog.bound_for(nb00.TIMEOUT_S) < nb00.TIMEOUT_S
    assert watchdog.bound_for(12.0) == 6.0


KERNEL_CELLS = ['''\
from tplab.exercises import nb00, nb01
from tplab.exercises.solutions import define''', '''\
def causal_mask(q_len, k_len):
    import torch
    mask = torch.ones(q_len, k_len, dtype=torch.bool)
    while True:
        mask = mask.tril()''', '''\
print(nb01.check_causal_mask(causal_mask))''', '''\
def ring_all_reduce(x):
    import torch.distributed as dist
    while dist.get_rank() < 2:
        x = x * 1''', '''\
print(nb00.check_ring_all_reduce(ring_all_reduce, world_sizes=(2,)))''', '''\
print(nb01.check_causal_mask(define("causal_mask")["causal_mask"]).ok)''']


@pytest.mark.timeout(300)
def test_in_a_notebook_kernel_the_cells_line_is_named_and_the_kernel_goes_on(monkeypatch):
    """In ipykernel, where a cell's source lives only in the kernel's memory: the loop in the kernel and the
    one in a rank are both named with the cell's line of code, and the next cell runs."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TPLAB_RETURN_BOUND_S", str(BOUND))     # inherited by the kernel and its ranks
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in KERNEL_CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    out = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert re.search("your causal_mask " + stopped_in("causal_mask", "while True:", "mask = mask.tril()"), out[2]), out
    assert re.search("world size 2: rank [01] " + stopped_in("ring_all_reduce", "while dist.get_rank() < 2:",
                                                             "x = x * 1"), out[4]), out
    assert out[5] == "True\n", out


def frame_of_code_saved_at(path) -> object:
    """A frame of a function whose code says it was read from ``path``."""
    namespace = {"sys": sys}
    exec(compile("def here():\n    return sys._getframe()\n", str(path), "exec"), namespace)
    return namespace["here"]()


def test_code_saved_beside_the_notebooks_is_the_learners_and_tplabs_own_is_not():
    """``your_parts()`` loads the exercise cells saved under notebooks/your_code/: a loop there is the learner's
    to be named, though it lives in the repository; tplab's own files never are."""
    package = Path(watchdog.__file__).resolve().parent.parent                   # tplab/
    assert watchdog._yours(frame_of_code_saved_at(package.parent / "notebooks" / "your_code" / "attention.py"))
    assert not watchdog._yours(frame_of_code_saved_at(package / "engine" / "model_runner.py"))


def test_a_loop_left_at_a_saved_cells_top_level_is_stopped_when_your_parts_reads_it(short_bound, tmp_path,
                                                                                    monkeypatch):
    from tplab.exercises import cells
    monkeypatch.setattr(cells, "YOUR_CODE", tmp_path)
    (tmp_path / "attention.py").write_text("# Exercise: attention\nsteps = 0\nwhile True:\n    steps += 1\n")
    with pytest.raises(RuntimeError, match=r"your code for exercise attention .* did not return within 3 s, "
                                           r"stopped in <module> \(line \d\)"):
        cells.your_code("attention")
    assert watchdog.call_bounded(1.0, sum, [1, 2]) == 3        # the process goes on
