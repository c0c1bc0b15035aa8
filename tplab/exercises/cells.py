"""Exercise cells: a notebook cell whose first line is ``# Exercise: <name>`` holds the learner's code
for exercise ``<name>``.

``workbook.setup()`` installs ``ExerciseCells`` in the kernel. Each time such a cell runs, its code is
kept in ``your_code/<name>.py`` beside the notebook, so that notebook 06's finale can put every part
you wrote into one engine (``your_parts``). In solution mode (``workbook.setup(solutions=True)`` or
``TPLAB_SOLUTIONS=1``) the cell runs the reference solution from ``tplab.exercises.solutions``
instead, and every checker must then say correct (``Checks.exercise``).
"""
import re
import types
from pathlib import Path

from tplab.exercises import solutions
from tplab.exercises.watchdog import DidNotReturn, bounded

EXERCISE = re.compile(r"#\s*Exercise:\s*(\w+)")
YOUR_CODE = Path("your_code")          # relative to the kernel's working directory: the notebook's folder


class ExerciseCells:
    """An IPython input transformer (``input_transformers_post``) that sees every cell before it runs."""

    def __init__(self, solution_mode: bool):
        self.solution_mode = solution_mode

    def __call__(self, lines: list[str]) -> list[str]:
        match = EXERCISE.match(lines[0]) if lines else None
        if match is None:
            return lines
        if self.solution_mode:
            return solutions.source(match.group(1)).splitlines(keepends=True)
        YOUR_CODE.mkdir(exist_ok=True)
        (YOUR_CODE / f"{match.group(1)}.py").write_text("".join(lines))
        return lines


def _kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def install(solution_mode: bool) -> None:
    """Watch exercise cells in the running IPython kernel, replacing an earlier watcher (no-op outside IPython)."""
    ip = _kernel()
    if ip is not None:
        kept = [t for t in ip.input_transformers_post if not isinstance(t, ExerciseCells)]
        ip.input_transformers_post[:] = kept + [ExerciseCells(solution_mode)]


def solution_mode() -> bool:
    """Whether the running kernel's exercise cells run the reference solutions."""
    ip = _kernel()
    watchers = [t for t in (ip.input_transformers_post if ip else []) if isinstance(t, ExerciseCells)]
    return bool(watchers and watchers[-1].solution_mode)


def your_code(name: str) -> dict | None:
    """What your last run of the cell ``# Exercise: <name>`` defines (the reference solution in solution
    mode), or None if you have not run it yet. A fresh module each time, so it travels to ranks by value."""
    path = YOUR_CODE / f"{name}.py"
    if solution_mode():
        return solutions.define(name)
    if not path.is_file():
        return None
    module = types.ModuleType(f"your_{name}")                       # not in sys.modules: pickled by value
    try:
        with bounded():                  # a loop left at the cell's top level must not freeze the notebook
            exec(compile(path.read_text(), str(path.resolve()), "exec"), module.__dict__)
    except DidNotReturn as e:
        raise RuntimeError(f"your code for exercise {name} ({path}, the last run of its cell) {e}") from None
    except Exception as e:
        raise RuntimeError(f"your code for exercise {name} ({path}, the last run of its cell) raises "
                           f"{type(e).__name__}: {e}") from e
    return vars(module)


def your_parts() -> dict:
    """``{field of tplab.Parts: your class}`` for every part exercise you have run, for ``LLM(parts=...)``."""
    found = {}
    for field, cls in solutions.PARTS.items():
        code = your_code(field)
        if code is not None and cls in code:
            found[field] = code[cls]
    return found
