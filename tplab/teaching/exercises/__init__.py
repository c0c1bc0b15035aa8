"""Exercises: the learner writes a function in a notebook, a checker says whether it is right.

Each notebook's module (``nb01`` ... ``nb06``) has ``check_<name>(fn)`` and a reference
solution ``solution_<name>``. Checkers compare against tplab or HF on fixed inputs and
report; they never print the solution. ``show_solution(nbXX.solution_name)`` does, for
when you are stuck.
"""
import inspect

NOT_DONE = "not attempted yet: fill in the function above and run this cell again"


class ExerciseResult:
    """Outcome of a checker: ``ok`` True/False, or None when the stub was left as it is."""

    def __init__(self, name: str, ok: bool | None, message: str):
        self.name, self.ok, self.message = name, ok, message

    def __repr__(self):
        mark = {True: "correct", False: "not right yet", None: "not attempted"}[self.ok]
        return f"{self.name}: {mark} | {self.message}"


def run_checker(name: str, fn, compare) -> ExerciseResult:
    """Call ``compare(fn)`` -> (ok, message); a stub that raises NotImplementedError or returns
    None counts as not attempted, any other exception as wrong (with the error shown)."""
    try:
        ok, message = compare(fn)
    except Exception as e:  # a learner's bug: say what it was, do not crash the notebook
        if isinstance(e, NotImplementedError) and _raised_by(fn, e):
            return ExerciseResult(name, None, NOT_DONE)   # the stub's own `raise NotImplementedError`
        return ExerciseResult(name, False, f"raised {type(e).__name__}: {e}")
    if ok is None:
        return ExerciseResult(name, None, NOT_DONE)
    return ExerciseResult(name, bool(ok), message)


def _raised_by(fn, error: BaseException) -> bool:
    """True when ``error`` was raised in ``fn``'s own body, not deeper (PyTorch raises
    NotImplementedError too, e.g. for an op without a kernel for some dtype)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is getattr(fn, "__code__", None)


def show_solution(solution) -> None:
    """Print a reference solution's source."""
    print(inspect.getsource(solution))


# The notebooks' modules, so that `from tplab.exercises import nb01` finds them on the package.
from tplab.teaching.exercises import nb00, nb01, nb02, nb03, nb04, nb05, nb06  # noqa: E402
