"""tplab.workbook: the conveniences the notebooks share."""
import json
from pathlib import Path

import pytest

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
    for line, row in zip(lines[3:], rows, strict=True):                 # each row's name and ratio, in order
        assert line.startswith(row["name"].strip()[:58]) and f"| {row['ratio']:6.3g} |" in line, (line, row)
    assert workbook._better({"unit": "tok/s"}) == "higher" and workbook._better({"unit": "MiB"}) == "lower"
    assert workbook._better({"unit": "MiB", "target": ">= 1.0"}) == "higher"


def test_ops_of_names_the_aten_ops_a_call_runs():
    import torch
    ops = workbook.ops_of(lambda: torch.ones(3).repeat_interleave(2))
    assert "aten::repeat_interleave" in ops and "aten::matmul" not in ops


def test_watch_records_each_call_as_it_returns_and_gives_the_method_back_even_on_an_error():
    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    c = Counter()
    with workbook.watch(c, "add", lambda total, k: (k, total)) as seen:
        c.add(2)
        c.add(3)
    assert seen == [(2, 2), (3, 5)] and "add" not in vars(c)      # the class's method again
    c.add(1)
    assert seen == [(2, 2), (3, 5)]
    own = lambda k: -k                                              # noqa: E731  (a method set on the instance)
    c.add = own
    try:
        with workbook.watch(c, "add", lambda out, k: out):
            raise KeyError("a cell that fails midway")
    except KeyError:
        pass
    assert c.add is own


def test_peak_bytes_counts_tensors_alive_together_and_forgets_freed_ones():
    import torch
    with workbook.PeakBytes() as peak:
        a = torch.ones(1000)                 # 4,000 B
        b = a * 2                            # 8,000 B alive
        del b
        c = a + 1                            # b freed: still 8,000
        del c                                # freed: 4,000 once the next op runs
        d = a.view(10, 100)                  # a view: no new storage
        d.add_(1)                            # in place: none either
    assert peak.peak == 8000 and peak.now == 4000, (peak.peak, peak.now)     # never freeing: 12,000 and 12,000


def test_machine_names_the_cpu_and_the_cores_this_process_may_use():
    import os
    name, cores = workbook.machine().rsplit(", ", 1)
    assert name and cores == f"{len(os.sched_getaffinity(0))} cores"
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "model name" in cpuinfo:
        assert f": {name}\n" in cpuinfo


@pytest.mark.parametrize("value, on", [("1", True), ("off", False), ("no", False), ("0", False), ("", False)])
def test_solution_mode_reads_tplab_solutions_as_the_other_switches_do(monkeypatch, value, on):
    """``TPLAB_SOLUTIONS=off`` is off, as ``TPLAB_ONEDNN=off`` is (it once turned solution mode on)."""
    from tplab.exercises import cells
    seen = []
    monkeypatch.setattr(cells, "install", seen.append)
    monkeypatch.setenv("TPLAB_SOLUTIONS", value)
    workbook.setup()
    assert seen == [on]
    monkeypatch.setenv("TPLAB_SOLUTIONS", "maybe")
    with pytest.raises(ValueError, match="TPLAB_SOLUTIONS='maybe' is neither on nor off"):
        workbook.setup()
    with pytest.raises(ValueError, match="solutions must be True, False or None"):
        workbook.setup(solutions="no")
