"""Ranks from a notebook cell: fresh processes sharing a real ``torch.distributed`` process group.

``launch(fn, world_size)`` (or a reusable ``RankGroup``) spawns the ranks, joins them into one group
and runs ``fn`` in each. ``fn`` and its results travel by value with cloudpickle, so ``fn`` may be
defined in a notebook cell; tensors come back on the CPU. A rank that raises, dies or hangs is
reported in the parent and every rank is stopped, so the cell can simply be run again.
"""
import atexit
import os
import pickle
import signal
import sys
import time
import weakref
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

from tplab.distributed import rank_start, stacks
from tplab.distributed.rank_process import rank_main

_BACKENDS = ("gloo", "nccl")


def pick_backend(world_size: int, backend: str | None = None) -> str:
    """Validate ``world_size``/``backend``; ``None`` means NCCL when there is a GPU per rank, else gloo."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None (pick automatically), got {backend!r}")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
                         f"are visible; use backend='gloo' or a smaller world_size")
    return backend


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, or ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` under an NCCL group, else ``cpu`` (also with no group)."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


class RankError(RuntimeError):
    """A rank raised or died. ``.rank`` is its number, ``.remote_traceback`` its traceback text ('' if it died)."""

    def __init__(self, rank: int, summary: str, remote_traceback: str = ""):
        super().__init__(f"{summary}\n{remote_traceback}".rstrip())
        self.rank, self.remote_traceback = rank, remote_traceback


_live: "weakref.WeakSet[RankGroup]" = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's own hook, so it runs before that one joins children
def _close_all():
    for group in list(_live):
        group.close()


def _death(rank: int, proc) -> RankError:
    proc.join(rank_start.KILL_GRACE_S)  # its pipe may close a moment before the process is gone
    code = proc.exitcode
    how = f"signal {-code}, {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return RankError(rank, f"rank {rank} died ({how})")


def _lost_peer(message: str) -> bool:
    """Whether a rank's error says a peer went away (gloo's or NCCL's transport), not a bug of its own."""
    return any(s in message for s in ("Connection reset", "Connection closed", "Broken pipe", "pair.cc", "NCCL"))


def _dead_peer(procs, rank: int, grace: float = 0.5) -> int | None:
    """A rank other than ``rank`` that has died, waiting up to ``grace`` seconds for one to be noticed:
    when a rank is killed its peers' collectives fail at once, and their error can reach the driver
    before the dead rank's exit does. The death is the cause to report."""
    others = {p.sentinel: r for r, p in enumerate(procs) if r != rank}
    ready = wait(list(others), grace)
    return others[ready[0]] if ready else None


MAX_TIMEOUT_S = 1e7              # 116 days: a wait of more overflows the clocks that time it


def check_timeout(timeout, name: str = "timeout") -> float:
    """``timeout`` as float seconds, when it is a number in (0, ``MAX_TIMEOUT_S``]; else a ValueError."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}, got {timeout!r}")
    return float(timeout)


def check_call_args(fn, args, kwargs) -> None:
    """``fn`` callable, ``args`` a tuple (or list) of its arguments, ``kwargs`` a dict or None; checked before any
    rank starts, so that ``args=(10.0)`` (a float: the comma is missing) is named here, not as a TypeError inside
    the ranks."""
    if not callable(fn):
        raise ValueError(f"fn must be a function (or another callable) to run in every rank, got "
                         f"{type(fn).__name__} {fn!r:.60}")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple of fn's arguments, got {type(args).__name__} {args!r:.60} "
                        f"(one argument: args=({args!r:.60},))")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"kwargs must be a dict of fn's keyword arguments or None, got {type(kwargs).__name__}")


class RankGroup:
    """`world_size` long-lived rank processes sharing one process group; run functions on all of them.

    Use as a context manager or call ``close()``. A rank failure, a timeout or Ctrl-C stops every
    rank and closes the group; create a new one to go on.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout: float = 300.0,
                 threads_per_rank: int | None = None):
        self.backend = pick_backend(world_size, backend)
        self.world_size, self.timeout = world_size, check_timeout(timeout)
        if threads_per_rank is not None and (not isinstance(threads_per_rank, int) or threads_per_rank < 1):
            raise ValueError(f"threads_per_rank must be None or an int >= 1, got {threads_per_rank!r}")
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)  # no oversubscription
        self._ranks = ranks = rank_start.Ranks()
        self._finalizer = weakref.finalize(self, ranks.stop)
        _live.add(self)
        # Port 0: the OS picks a free port and the store holds it, so ranks cannot race for a port.
        ranks.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        ctx = rank_start.rank_context()
        parent, pdeathsig = rank_start.death_watch(ctx)
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=True)
                stack_in, stack_out = ctx.Pipe(duplex=False)      # where the rank says where it is (stacks)
                proc = ctx.Process(target=rank_main, name=f"tplab-rank-{rank}", args=(
                    rank, world_size, self.backend, ranks.store.port, self.timeout, threads, there, stack_out,
                    parent, pdeathsig, dict(os.environ)))
                with rank_start.ctrl_c_deferred():   # so that a rank started is a rank known, to be stopped
                    rank_start.start(proc)
                    ranks.procs.append(proc)
                there.close()  # so that a dead rank shows up as EOF on our end
                stack_out.close()
                ranks.conns.append(here)
                ranks.stacks.append(stack_in)
            self._collect(self.timeout)  # every rank has joined the group (or the failure is raised)
        except BaseException:
            self._abort()
            raise

    def run(self, fn, args=(), kwargs=None, timeout: float | None = None, straggle: float | None = None) -> list:
        """Call ``fn(*args, **kwargs)`` in every rank; return the per-rank results in rank order. ``straggle``: for
        a call that takes the ranks about as long, the seconds the others may lag the first answer (or twice its
        time, if more); a rank later than that waits in a collective a rank that answered never joins."""
        return self._send("run", fn, args, kwargs, timeout, straggle)

    def create(self, factory, args=(), kwargs=None, timeout: float | None = None) -> None:
        """Make ``factory(*args, **kwargs)`` in every rank and keep it there for ``call``."""
        self._send("create", factory, args, kwargs, timeout)

    def call(self, method, args=(), kwargs=None, timeout: float | None = None) -> list:
        """``method(obj, *args, **kwargs)`` in every rank, ``obj`` the object ``create`` made there (e.g.
        ``group.call(Worker.generate, (prompts, params))``); the per-rank results in rank order."""
        return self._send("call", method, args, kwargs, timeout)

    def _send(self, kind: str, fn, args, kwargs, timeout: float | None, straggle: float | None = None) -> list:
        if self._ranks.stopped:
            raise RuntimeError("this RankGroup is closed (close() was called, or a rank failed or timed out); "
                               "create a new RankGroup")
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        straggle = None if straggle is None else check_timeout(straggle, "straggle")
        check_call_args(fn, args, kwargs)
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))  # a pickling error leaves us usable
        try:
            for rank, conn in enumerate(self._ranks.conns):
                try:
                    conn.send_bytes(pickle.dumps((kind, payload)))
                except OSError:
                    raise _death(rank, self._ranks.procs[rank]) from None
            return self._collect(timeout, straggle)
        except BaseException:  # a failure, a timeout or Ctrl-C: no rank may be left half-way through
            self._abort()
            raise

    def _collect(self, timeout: float, straggle: float | None = None) -> list:
        """Relay output and gather one reply per rank; raise on the first failure or at the deadline (``run``'s
        ``straggle`` brings it closer at the first answer)."""
        ranks, results, pending = self._ranks, [None] * self.world_size, set(range(self.world_size))
        start = time.monotonic()
        deadline, lag = start + timeout, None      # lag: the straggle allowed, once it set the deadline

        def handle(rank, msg):
            nonlocal deadline, lag
            if msg[0] == "out":
                stream = sys.stdout if msg[1] == "stdout" else sys.stderr
                stream.write("".join(f"[rank {rank}] {line}" for line in msg[2].splitlines(keepends=True)))
                stream.flush()
            elif msg[0] == "ok":
                results[rank] = cloudpickle.loads(msg[1])
                pending.discard(rank)
                took = time.monotonic() - start
                allowed = None if straggle is None or lag is not None else max(straggle, 2 * took)
                if allowed is not None and start + took + allowed < deadline:     # the first answer: the others soon
                    deadline, lag = start + took + allowed, allowed
            else:
                dead = _dead_peer(ranks.procs, rank) if _lost_peer(msg[2]) else None
                if dead is not None:  # the survivor's error (a reset connection) follows from that death
                    err = _death(dead, ranks.procs[dead])
                    raise RankError(dead, f"{err}; then rank {rank} failed: {msg[1]}: {msg[2]}", msg[3])
                raise RankError(rank, f"rank {rank} failed: {msg[1]}: {msg[2]}", msg[3])

        owner = {c: r for r, c in enumerate(ranks.conns)} | {p.sentinel: r for r, p in enumerate(ranks.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                seen = stacks.where({r: ranks.procs[r].pid for r in pending}, dict(enumerate(ranks.stacks)))
                raise stacks.RanksDidNotAnswer(sorted(pending), timeout, self.world_size, seen, lag)
            # Sentinels too: a rank killed by a signal is noticed at once, not at the deadline.
            for ready in wait([ranks.conns[r] for r in pending] + [p.sentinel for p in ranks.procs], left):
                rank = owner[ready]
                conn, exited = ranks.conns[rank], ready is not ranks.conns[rank]
                while conn.poll():  # one message per wake-up, but all that an exited rank left behind
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise _death(rank, ranks.procs[rank]) from None
                    handle(rank, msg)
                    if not exited:
                        break
                if exited:
                    raise _death(rank, ranks.procs[rank])
        return results

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or a failure stopped the ranks."""
        return self._ranks.stopped

    def _abort(self):
        self._ranks.stop(graceful=False)
        self._finalizer.detach()

    def close(self):
        """Destroy the process group in every rank and stop all rank processes. Safe to call twice."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"RankGroup({self.world_size}, backend={self.backend!r}{', closed' * self._ranks.stopped})"


def launch(fn, world_size: int, args=(), kwargs=None, backend: str | None = None, timeout: float = 300.0) -> list:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` fresh ranks and return their results in rank order.

    ``RankGroup(...)`` for one ``run()``, always closed afterwards; ``timeout`` bounds start-up and the run.
    """
    check_call_args(fn, args, kwargs)
    with RankGroup(world_size, backend=backend, timeout=timeout) as group:
        return group.run(fn, args, kwargs)
