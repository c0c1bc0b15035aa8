"""Learner code that never returns: stopped after a bound, with where it was stuck, and the kernel keeps working.

    with bounded():                 # in the notebook's kernel, or inside a rank
        fn(x)                       # a `while True:` here ends in DidNotReturn after BOUND_S seconds

A watchdog thread waits for the block to end. At the bound it reads the stuck thread's stack
(``sys._current_frames()``), finds the learner's innermost frame (the first one outside tplab, torch and
the standard library) and raises ``DidNotReturn`` in that thread with ``PyThreadState_SetAsyncExc``: the
way a debugger stops a thread, on Linux, macOS and Windows alike, from any thread (SIGALRM works only on
POSIX and only in the main thread). The exception is raised at the next Python bytecode the thread runs,
so an endless Python loop stops at once; a single C call that never returns (a ``recv`` nobody answers)
is left to the ranks' own timeouts. While the thread waits inside a collective (``torch.distributed`` or
``tplab.distributed``) it is not the one stuck, a peer is: the watchdog leaves it alone, so only the rank
that spins is named; nor is a thread still importing a module for tplab or torch (a loaded machine makes
that slow), only a learner's code.

``DidNotReturn`` is a ``BaseException``, as ``KeyboardInterrupt`` is, so that a learner's ``except
Exception:`` inside the loop does not swallow it; the checkers catch it by name.
"""
import ctypes
import functools
import linecache
import os
import re
import sys
import sysconfig
import threading

# A correct part or exercise function returns within seconds (the figures: docs/performance-journal.md).
# 30 s is far above that, and under the ranks' timeouts (nb00's 60 s,
# check_part's 90 s): see bound_for.
def _bound_from_environment(default: float = 30.0) -> float:
    text = os.environ.get("TPLAB_RETURN_BOUND_S", "")
    try:
        bound = float(text) if text else default
    except ValueError:
        bound = float("nan")
    if not bound > 0:
        raise ValueError(f"TPLAB_RETURN_BOUND_S={text!r}: set it to the seconds learner code may run before it "
                         f"is stopped (a number > 0; {default:g} if unset)")
    return bound


BOUND_S = _bound_from_environment()
# Ranks that do the same work (a part's probe, one engine's prefill): a rank this long behind one that has answered
# waits in a collective that rank never joins (RankGroup.run's straggle).
STRAGGLE_S = 10.0
_RETRY_S = 1.0           # a bare `except:` in the loop swallowed it: raise it again, this often
_NOT_YOURS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,      # tplab/
                    *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))})
_WAITING = (os.sep + os.path.join("torch", "distributed") + os.sep,
            os.sep + os.path.join("tplab", "distributed") + os.sep)
_IMPORTING = ("importlib._bootstrap", os.path.join("importlib", "_bootstrap"))   # frozen, or a stdlib file


class DidNotReturn(BaseException):
    """The learner's code ran past the bound and was stopped; the message says where."""
    message = "did not return"

    def __init__(self, *args):
        super().__init__(*(args or (self.message,)))


def _yours(frame) -> bool:
    name = frame.f_code.co_filename
    return not (name.startswith("<frozen") or name.startswith(_NOT_YOURS))


def _above(frame, base):
    """The frames from ``frame`` (the innermost) down to, not including, ``base`` (the ``with``'s frame)."""
    while frame is not None and frame is not base:
        yield frame
        frame = frame.f_back


def _waiting(frame, base) -> bool:
    """Whether the block (the stack from ``frame`` down to ``base``) waits in a collective, or for ranks."""
    return any(w in f.f_code.co_filename for f in _above(frame, base) for w in _WAITING)


def _loading(frame, base) -> bool:
    """Whether the block is importing a module for tplab or torch (slow on a loaded machine, not a loop): an
    import machinery frame comes before any of the learner's, from the innermost out."""
    for f in _above(frame, base):
        if any(w in f.f_code.co_filename for w in _IMPORTING):
            return True
        if _yours(f):
            return False
    return False


def _stuck(frame, base):
    """The innermost of the learner's frames in the block (``frame`` itself if none is)."""
    return next((f for f in _above(frame, base) if _yours(f)), frame)


def where(frame) -> str:
    """``"forward (line 12): `while True:`"``: a frame's function, line and (where this process has it) code."""
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    return f"{name} (line {frame.f_lineno})" + (f": `{code}`" if code else "")


def _message(bound: float, place: str) -> str:
    return (f"did not return within {bound:g} s, stopped in {place}. An endless loop? (a correct one returns "
            f"within a couple of seconds; the bound is {bound:g} s, TPLAB_RETURN_BOUND_S sets it)")


def _raise_in(thread_id: int, exc_type) -> None:
    obj = ctypes.py_object(exc_type) if exc_type is not None else ctypes.py_object()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), obj)


class bounded:
    """``with bounded(bound_s):`` runs the block; if it has not ended after ``bound_s`` seconds (default
    ``BOUND_S``), ``DidNotReturn`` is raised in it, naming the learner's function and line it was stuck on."""

    def __init__(self, bound_s: float | None = None):
        self.bound = BOUND_S if bound_s is None else float(bound_s)
        self._done, self._lock, self._fired = threading.Event(), threading.Lock(), None

    def __enter__(self):
        self._target, self._base = threading.get_ident(), sys._getframe(1)
        threading.Thread(target=self._watch, name="tplab-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._done.set()
            if self._fired is not None:          # raised too late to land inside the block: never outside it
                _raise_in(self._target, None)
            self._base = self._fired = None
        return False

    def _watch(self):
        if self._done.wait(self.bound):
            return
        # Again every second while a bare `except:` in the loop swallows it; at once when it waited in a collective.
        while not self._fire_once():
            if self._done.wait(_RETRY_S if self._fired else 0.2):
                return

    def _fire_once(self) -> bool:
        """Raise ``DidNotReturn`` in the target thread if it is stuck in its own code; True: stop watching."""
        frame = sys._current_frames().get(self._target)
        try:
            with self._lock:
                if self._done.is_set() or frame is None:
                    return True
                if self._fired is not None:      # retry only while the frame it was stuck in still runs
                    if not any(f is self._fired[1] for f in _above(frame, self._base)):
                        return True
                elif _waiting(frame, self._base) or _loading(frame, self._base):
                    return False                 # a rank waiting for its peers, or importing, is not stuck
                else:
                    stuck = _stuck(frame, self._base)
                    message = _message(self.bound, where(stuck))
                    self._fired = (type("DidNotReturn", (DidNotReturn,), {"message": message}), stuck)
                _raise_in(self._target, self._fired[0])
                return False
        finally:
            del frame


def call_bounded(bound_s: float | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside ``bounded(bound_s)``: what a rank runs (``group.run(call_bounded, ...)``)."""
    with bounded(bound_s):
        return fn(*args, **kwargs)


def bounded_calls(fn, bound_s: float | None = None):
    """``fn`` with every call inside ``bounded(bound_s)``: what a checker hands to its comparisons."""
    @functools.wraps(fn)
    def each_call(*args, **kwargs):
        with bounded(bound_s):
            return fn(*args, **kwargs)
    return each_call


def bound_for(timeout: float) -> float:
    """The bound for learner code inside ranks that ``timeout`` stops: under it, so the watchdog names the
    stuck rank and line before the ranks' own timeout reports only that they did not answer."""
    return min(BOUND_S, timeout / 2)


def from_rank(error) -> str | None:
    """For a ``RankError`` whose rank was stopped by the watchdog: ``"rank 1 did not return within ..."``,
    with the learner's line of code read here (the rank has no copy of a notebook cell's source)."""
    text = str(error).splitlines()[0]
    found = re.search(r"failed: DidNotReturn: (.*)", text)
    if not found:
        return None
    message = found.group(1)
    place = re.search(r"stopped in (\S+) \(line (\d+)\)(:)?", message)
    if place and not place.group(3):         # no source there: look for it here, from the traceback's file
        function, line = place.group(1).rsplit(".", 1)[-1], place.group(2)
        # the file from the traceback (which may show the loop's other line: the exception lands a moment later)
        files = re.findall(rf'File "([^"]+)", line \d+, in {re.escape(function)}\b', error.remote_traceback)
        code = linecache.getline(files[-1], int(line)).strip() if files else ""
        if code:
            message = message.replace(place.group(0), f"{place.group(0)}: `{code}`", 1)
    return f"rank {error.rank} {message}"
