"""Every notebook runs top to bottom twice in one kernel, without a restart (a learner's Run All, again).

nbval (in the README's test command) already runs each notebook once in a fresh kernel and compares
the marked outputs; this adds the second pass, which catches state that breaks on re-run.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_twice_in_one_kernel(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for _ in range(2):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)     # raises CellExecutionError on any error
