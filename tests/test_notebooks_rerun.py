"""Every notebook runs top to bottom twice in one kernel, without a restart (a learner's Run All, again),
in solution mode: every ``# Exercise:`` cell runs its reference solution and every checker must say correct.

nbval (in the README's test command) runs each notebook once as committed, in a fresh kernel, with the
exercises' stubs ("not attempted", nothing fails), and compares the marked outputs. This test adds the
other half: the whole track end to end with the reference solutions (``checks.exercise`` asserts each
one correct in solution mode), and a second pass that catches state that breaks on re-run.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_twice_in_one_kernel_in_solution_mode(path, monkeypatch):
    monkeypatch.setenv("TPLAB_SOLUTIONS", "1")               # inherited by the kernel started below
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    expected = sum(c.source.count("checks.exercise(") for c in nb.cells if c.cell_type == "code")
    probe = nbformat.v4.new_code_cell(
        "from tplab.teaching import exercise_cells\n"
        "print(exercise_cells.solution_mode(), len([n for n in checks.results if n.startswith('solution: ')]))")
    with client.setup_kernel():
        for _ in range(2):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)     # raises CellExecutionError on any error
        nb.cells.append(probe)
        client.execute_cell(probe, len(nb.cells) - 1)
    # every checker ran on its reference solution and said correct (Checks.exercise asserts it)
    printed = "".join(o.get("text", "") for o in probe.outputs if o.get("output_type") == "stream")
    assert printed.split() == ["True", str(expected)], probe.outputs
