"""Exercises: the learner writes a function or a part in a notebook, a checker says whether it is right.

Each notebook's module (``nb00`` to ``nb08``; notebook 07 has none) has ``check_<name>(fn)``; ``check_part`` runs a
learner's part inside the real engine against HF. Checkers compare against tplab or HF on fixed
inputs and say what looks wrong; they never print the solution. ``show_solution(name)`` does,
for when you are stuck (the reference solutions are in ``tplab.exercises.solutions``).
"""
import contextlib
import linecache
import re

import torch

from tplab.exercises import solutions
from tplab.exercises.watchdog import DidNotReturn, bounded_calls

NOT_DONE = "not attempted yet: fill in the stub above (replace its `raise NotImplementedError`) and run it again"
FORGOT_RETURN = "returned None: did you forget `return`?"


def not_a_tensor(value, expected: str = "a torch.Tensor") -> str | None:
    """What to tell a learner whose function returned ``value`` where ``expected`` belongs, or None for a tensor."""
    if value is None:
        return FORGOT_RETURN
    if not isinstance(value, torch.Tensor):
        return f"returned {type(value).__name__}, expected {expected}"
    return None


class ExerciseResult:
    """Outcome of a checker: ``ok`` True/False, or None when the stub was left as it is."""

    def __init__(self, name: str, ok: bool | None, message: str):
        self.name, self.ok, self.message = name, ok, message

    def __repr__(self):
        mark = {True: "correct", False: "not right yet", None: "not attempted"}[self.ok]
        return f"{self.name}: {mark} | {self.message}"


@contextlib.contextmanager
def float32_default():
    """The default dtype float32 meanwhile: the checks make their inputs with it, here and in their ranks (which
    start with it), for the shipped float32 model; a notebook's ``torch.set_default_dtype`` must not change a
    verdict."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def run_checker(name: str, fn, compare, bound: bool = True) -> ExerciseResult:
    """Call ``compare(fn)`` -> (ok, message). The stub's own ``raise NotImplementedError`` counts
    as not attempted; any other exception as wrong, with the error shown. A call of ``fn`` that does not
    return within ``watchdog.BOUND_S`` is stopped and its line named (``bound=False``: ``compare`` does that)."""
    try:
        with float32_default():
            ok, message = compare(bounded_calls(fn) if bound else fn)
    except DidNotReturn as e:
        return ExerciseResult(name, False, f"your {name} {e}")
    except (Exception, SystemExit) as e:  # a learner's bug (a sys.exit too): say what it was, keep the notebook
        if is_stub_error(fn, e):
            return ExerciseResult(name, None, NOT_DONE)
        return ExerciseResult(name, False, f"raised {type(e).__name__}: {e}")
    return ExerciseResult(name, bool(ok), message)


def own_code(obj) -> set:
    """The code objects of a function, or of the methods a class defines itself (of each, for a list)."""
    if isinstance(obj, (list, tuple)):
        return set().union(*map(own_code, obj)) if obj else set()
    if isinstance(obj, type):
        return {f.__code__ for f in vars(obj).values() if hasattr(f, "__code__")}
    return {obj.__code__} if hasattr(obj, "__code__") else set()


def learner_line(impl, text: str) -> str:
    """Where in the learner's code a traceback (text) went wrong: ``" in forward, line 12: y = ..."``."""
    files = {c.co_filename for c in own_code(impl)}
    hits = [(f, int(n), fn) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text) if f in files]
    if not hits:
        return ""
    filename, lineno, function = hits[-1]
    code = linecache.getline(filename, lineno).strip()
    return f" in your {function}, line {lineno}" + (f": `{code}`" if code else "")


def is_stub_error(obj, error: BaseException) -> bool:
    """True for a NotImplementedError raised in ``obj``'s own body (a function, or a class's methods),
    not deeper: PyTorch raises NotImplementedError too, e.g. for an op with no kernel for a dtype."""
    if not isinstance(error, NotImplementedError):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code in own_code(obj)


def show_solution(name: str) -> None:
    """Print the reference solution of exercise ``name`` (the name after ``# Exercise:`` in its cell)."""
    print(solutions.source(name))


# The notebooks' modules, so that `from tplab.exercises import nb01` finds them on the package.
from tplab.exercises import nb00, nb01, nb02, nb03, nb04, nb05, nb06, nb08  # noqa: E402
from tplab.exercises.parts import check_engine, check_part  # noqa: E402
