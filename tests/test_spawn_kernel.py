"""The spawn path, as macOS and Windows take it, from a notebook kernel: ``TPLAB_START_METHOD=spawn`` on Linux.

A fresh kernel runs notebook 00 up to its ring all-reduce exercise (the collectives in real ranks, and the
ring checker on the reference solution, which sends that cell-defined function to 3 and then 2 ranks),
then an LLM at TP 2 built with a row-parallel layer defined in a cell, against HF's greedy tokens. Every
rank must be a spawned child of the kernel, not a fork of the fork server Linux uses by default.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tplab.exercises import solutions

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "00_why_tensor_parallel.ipynb"

GENERATE = '''\
import os
import psutil
from tplab import LLM, SamplingParams
from tplab.exercises.in_engine import reference

def how_started():
    import multiprocessing, os
    return multiprocessing.get_start_method(allow_none=True), os.getppid()

ref = reference()
with LLM(ref["model"], tensor_parallel_size=2, parts={"row_linear": MyRowParallelLinear}) as llm:
    spawned = [c for c in psutil.Process().children() if "spawn_main" in " ".join(c.cmdline())]
    outs = llm.generate(ref["prompts"], SamplingParams(max_tokens=12, ignore_eos=True))
checks("ranks started by spawn, children of this kernel", ranks.run(how_started) == [("spawn", os.getpid())] * 2)
checks("the LLM's two ranks spawned too", len(spawned) == 4, f"{len(spawned)} spawned children")
checks("TP 2 with a cell-defined row_linear: HF's greedy tokens", [o.token_ids for o in outs] == ref["tokens"])
ranks.close()
checks.assert_all()
'''


@pytest.mark.timeout(600)
def test_notebook_00s_collectives_and_a_tp2_generation_run_under_spawn_from_a_kernel(monkeypatch):
    monkeypatch.setenv("TPLAB_START_METHOD", "spawn")        # inherited by the kernel started below
    monkeypatch.setenv("TPLAB_SOLUTIONS", "1")                # the ring exercise runs its reference solution
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    last = next(i for i, c in enumerate(code) if "check_ring_all_reduce(" in c.source)
    nb.cells = code[:last + 1] + [nbformat.v4.new_code_cell(solutions.source("row_linear")),
                                  nbformat.v4.new_code_cell(GENERATE)]
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
                   ).execute()                                # raises CellExecutionError on any failed check
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "solution: ring_all_reduce | the reference solution passes | ok" in printed
    assert "ranks started by spawn, children of this kernel | ok" in printed
    assert "TP 2 with a cell-defined row_linear: HF's greedy tokens | ok" in printed
