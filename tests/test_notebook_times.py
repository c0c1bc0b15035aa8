"""The notebook run times that README.md and docs/workshop.md quote are the ones in bench/notebook_times.json,
the file scripts/doctor.py scales; every notebook has one. Nothing here is timed: bench/notebook_times.py
measures the notebooks again, beside these numbers."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load(ROOT / "bench" / "notebook_times.py", "bench_notebook_times")
QUOTED = bench.claims()["notebooks"]


def _minutes(column: str) -> str:
    return f"{sum(t[column] for t in QUOTED.values()) / 60:.1f} min"


def test_every_notebook_has_its_times_and_nothing_else():
    assert sorted(QUOTED) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert all(set(t) == {"committed", "solutions"} and min(t.values()) > 0 for t in QUOTED.values())


def test_the_readme_quotes_them():
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| \[(\d\d) · [^|]*\]\([^)]*\) \|.*\| (\d+) s \|$", readme, re.M))
    assert rows == {name[:2]: str(t["committed"]) for name, t in QUOTED.items()}
    assert f"All nine take {_minutes('committed').replace(' min', ' minutes')} that way" in readme


def test_the_workshop_guide_quotes_them():
    guide = (ROOT / "docs" / "workshop.md").read_text()
    rows = {n: (int(a), int(b)) for n, a, b in re.findall(r"^\| (\d\d) · [^|]+\| (\d+) s \| (\d+) s \|", guide, re.M)}
    assert rows == {name[:2]: (t["committed"], t["solutions"]) for name, t in QUOTED.items()}
    assert f"| all (00 to 08) | {_minutes('committed')} | {_minutes('solutions')} |" in guide


def test_doctor_scales_the_same_numbers():
    doctor = _load(ROOT / "scripts" / "doctor.py", "doctor_for_times")
    assert doctor.REFERENCE_NOTEBOOK_SECONDS == {name: t["committed"] for name, t in QUOTED.items()}
    assert doctor.REFERENCE_RANKS_SECONDS == bench.claims()["ranks_seconds"]


@pytest.mark.parametrize("column", ["committed", "solutions"])
def test_the_script_prints_measured_beside_quoted(column):
    measured = {name: 2.0 * t[column] for name, t in list(QUOTED.items())[:2]}
    lines = bench.table(measured, QUOTED, column)
    assert len(lines) == 3 and all(line.rstrip().endswith("2.00x") for line in lines)
    first = next(iter(measured))
    assert lines[0].startswith(first) and f"quoted {QUOTED[first][column]:4d} s" in lines[0]
