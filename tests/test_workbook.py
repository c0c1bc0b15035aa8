"""tplab.workbook: the conveniences the notebooks share."""
import json
from pathlib import Path

from tplab import workbook


def test_the_bench_table_shows_every_row_of_the_newest_run_with_the_way_it_should_go(capsys):
    """Notebook 06's table of ``bench/run_all.py``'s results: one line per row with a ratio, rates better higher,
    times and memory lower, a target's own direction first."""
    workbook.show_bench_results()
    lines = capsys.readouterr().out.splitlines()
    newest = max((p for p in Path(workbook.__file__).resolve().parents[1].glob("bench/results/*/run_all.json")
                  if p.parent.name != "quick"), key=lambda p: p.stat().st_mtime)
    rows = workbook._bench_rows(json.loads(newest.read_text()))
    assert lines[0].startswith("measured on ") and lines[2].startswith("measurement")
    assert len(lines) == 3 + len(rows) and len(rows) > 10, lines
    assert workbook._better({"unit": "tok/s"}) == "higher" and workbook._better({"unit": "MiB"}) == "lower"
    assert workbook._better({"unit": "MiB", "target": ">= 1.0"}) == "higher"


def test_ops_of_names_the_aten_ops_a_call_runs():
    import torch
    ops = workbook.ops_of(lambda: torch.ones(3).repeat_interleave(2))
    assert "aten::repeat_interleave" in ops and "aten::matmul" not in ops
