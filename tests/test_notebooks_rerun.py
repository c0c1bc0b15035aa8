"""Every notebook runs top to bottom twice in one kernel, without a restart (a learner's Run All, again),
in solution mode and with the CPU kernels changed: every ``# Exercise:`` cell runs its reference solution,
every checker must say correct, and the outputs nbval checks must come out as saved, both times.

nbval (in the README's test command) runs each notebook once as committed, in a fresh kernel, with the
exercises' stubs ("not attempted", nothing fails), and compares the marked outputs. This test adds the
other half: the whole track end to end with the reference solutions (``checks.exercise`` asserts each
one correct in solution mode), and a second pass that catches state that breaks on re-run. Its kernel runs
with oneDNN off and one thread (``TPLAB_ONEDNN=0 OMP_NUM_THREADS=1``), which is how another machine
perturbs the numbers: every check must still hold, and every cell tagged ``nbval-check-output`` must still
show its saved output, compared as nbval compares it (``--nbval-lax``, masked by ``nbval_sanitize.cfg``).
"""
import copy
import re
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbval.plugin import coalesce_streams, get_sanitize_patterns

from conftest import NOTEBOOKS

ROOT = Path(__file__).parents[1]
SANITIZE = get_sanitize_patterns((ROOT / "nbval_sanitize.cfg").read_text())
# the fields nbval leaves out of its comparison (without --nbdime, images too)
NOT_COMPARED = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}


def compared(outputs) -> dict:
    """What nbval compares of a cell's outputs: each stream's text by its name, and every other field and
    MIME type but those above, sanitized with ``nbval_sanitize.cfg``, in order (``IPyNbCell.compare_outputs``)."""
    seen = defaultdict(list)
    for out in coalesce_streams(copy.deepcopy(outputs)):
        fields = {out.name: out.text} if out.output_type == "stream" else {**out, **out.get("data", {})}
        for key, value in fields.items():
            if key in NOT_COMPARED or key == "data":
                continue
            for regex, replace in SANITIZE:
                value = re.sub(regex, replace, value) if isinstance(value, str) else value
            seen[key].append(value)
    return dict(seen)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_twice_in_one_kernel_in_solution_mode(path, monkeypatch):
    for name, value in {"TPLAB_SOLUTIONS": "1", "TPLAB_ONEDNN": "0", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)                      # inherited by the kernel started below
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]     # nbval's "Cell n" is code[n]
    checked = {n: compared(nb.cells[i].outputs) for n, i in enumerate(code)      # nbval skips unrun cells
               if "nbval-check-output" in nb.cells[i].metadata.get("tags", [])
               and nb.cells[i].execution_count is not None}
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    expected = sum(c.source.count("checks.exercise(") for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_code_cell(
        "from tplab.exercises import cells as exercise_cells\n"
        "print(exercise_cells.solution_mode(), len([n for n in checks.results if n.startswith('solution: ')]))")
    with client.setup_kernel():
        for run in ("first", "second"):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)     # raises CellExecutionError on any error
            for n, saved in checked.items():
                got = compared(nb.cells[code[n]].outputs)
                assert got == saved, f"{run} run, {path.name}::Cell {n}: {got} != saved {saved}"
        nb.cells.append(probe)
        client.execute_cell(probe, len(nb.cells) - 1)
    # every checker ran on its reference solution and said correct (Checks.exercise asserts it)
    printed = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
    assert printed.split() == ["True", str(expected)], probe.outputs
