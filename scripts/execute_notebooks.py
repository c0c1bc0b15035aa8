"""Re-execute notebooks in place, as committed (the exercises' stubs, not solution mode), saving their
outputs and widget state, so they read well before a kernel runs:

    ./workbook.sh python scripts/execute_notebooks.py                 # all of notebooks/
    ./workbook.sh python scripts/execute_notebooks.py notebooks/03_rope_shapes.ipynb
"""
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)         # no timestamps: they would change on every run
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True, record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    os.environ.pop("TPLAB_SOLUTIONS", None)          # committed outputs show the stubs
    root = Path(__file__).resolve().parents[1] / "notebooks"
    for path in [Path(p) for p in sys.argv[1:]] or sorted(root.glob("*.ipynb")):
        print(f"{path.name}: {execute(path):.0f} s", flush=True)
