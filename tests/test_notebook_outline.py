"""Each notebook reads as a lesson: its sections numbered 1, 2, 3, ... in order, then a Summary, Further
exercises and their Answers, one answer to each exercise (bullets or a numbered list)."""
import json
import re

import pytest

from conftest import NOTEBOOKS

ENDING = ["## Summary", "## Further exercises", "### Answers"]


def outline_problems(nb: dict) -> list[str]:
    """What is out of place in the notebook's outline, as readable lines (empty when it reads in order)."""
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    problems = []
    numbers = [int(n) for n in re.findall(r"^## (\d+)\.", text, re.M)]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"sections numbered {numbers}, not 1 to {len(numbers)} in order")
    places = [text.find("\n" + heading + "\n") for heading in ENDING]
    if -1 in places or places != sorted(places):
        return problems + [f"it does not end with {', '.join(ENDING)}, in that order"]
    items = lambda part: len(re.findall(r"^(?:\*|\d+\.) ", part, re.M))
    exercises, answers = items(text[places[1]:places[2]]), items(text[places[2]:])
    if exercises != answers:
        problems.append(f"{exercises} further exercises and {answers} answers")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_reads_in_order(path):
    problems = outline_problems(json.loads(path.read_text()))
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_outline_check_can_fail():
    """Two sections of one number, and an exercise without its answer, are both caught."""
    nb = json.loads(NOTEBOOKS[0].read_text())
    assert not outline_problems(nb)
    markdown = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    markdown[-1]["source"] = ["## 2. A second section 2\n"] + markdown[-1]["source"]
    answers = next(c for c in markdown if "### Answers" in "".join(c["source"]))
    answers["source"] = "".join(answers["source"]).split("\n1. ")[0].splitlines(keepends=True)
    problems = outline_problems(nb)
    assert any("sections numbered" in p for p in problems) and any("answers" in p for p in problems), problems
