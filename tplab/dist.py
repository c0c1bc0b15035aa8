"""Ranks from a notebook cell: fresh processes sharing a real ``torch.distributed`` group.

``launch(fn, world_size)`` (or a reusable ``RankGroup``) starts ``world_size`` processes with
the "spawn" method, joins them into one process group and runs ``fn`` in each. ``fn`` travels
by value with cloudpickle, so it may live in a notebook cell or be a closure; return values
come back the same way, tensors moved to the CPU. A failing, dying or hanging rank is reported
in the parent and every rank is stopped, so a cell can be re-run at once.
"""
import atexit
import ctypes
import io
import multiprocessing as mp
import multiprocessing.spawn
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

_BACKENDS = ("gloo", "nccl")
_KILL_GRACE_S = 2.0  # SIGTERM -> SIGKILL delay when stopping ranks


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


# --------------------------------------------------------------------------- inside a rank

class _Forward(io.TextIOBase):
    """sys.stdout/err replacement in a rank: ships whole lines to the parent as they are written."""

    encoding, errors = "utf-8", "replace"

    def __init__(self, send, stream: str):
        self._send, self._stream, self._buf, self._lock = send, stream, "", threading.Lock()

    def write(self, text):
        with self._lock:
            self._buf += text
            # Keep a partial line until its newline so "[rank N] " prefixes stay at line starts.
            head, sep, self._buf = self._buf.rpartition("\n")
        if sep:
            self._send(("out", self._stream, head + sep))
        return len(text)

    def flush_all(self):
        with self._lock:
            rest, self._buf = self._buf, ""
        if rest:
            self._send(("out", self._stream, rest + "\n"))


def _to_cpu(x):
    """Detached CPU copies of every tensor in nested lists/tuples/dicts, so results pickle by value."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").clone()
    if isinstance(x, dict):
        return type(x)((k, _to_cpu(v)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_to_cpu(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _watch_parent(parent_pid: int):
    # Fallback for platforms without PR_SET_PDEATHSIG: once the parent is gone we are re-parented.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _rank_main(rank, world_size, backend, port, timeout_s, threads, conn, parent_pid, pdeathsig):
    """Entry point of a rank process (module level so spawn can find it without the user's __main__)."""
    if pdeathsig and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us

    send_lock = threading.Lock()

    def send(msg):
        data = cloudpickle.dumps(msg)
        try:
            with send_lock:
                conn.send_bytes(data)
        except OSError:  # parent gone
            os._exit(1)

    out, err = _Forward(send, "stdout"), _Forward(send, "stderr")
    sys.stdout, sys.stderr = out, err

    def run_reporting(fn):
        try:
            reply = ("ok", cloudpickle.dumps(_to_cpu(fn())))
        except BaseException as e:
            reply = ("err", type(e).__qualname__, str(e), traceback.format_exc())
        out.flush_all()
        err.flush_all()
        send(reply)
        return reply[0] == "ok"

    def init():
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    if not run_reporting(init):
        return
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent closed our pipe: nothing more to do
            break
        if msg[0] == "close":
            break
        fn, args, kwargs = cloudpickle.loads(msg[1])
        run_reporting(lambda: fn(*args, **kwargs))
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- in the parent

_spawn_lock = threading.Lock()


def _start_without_main(proc):
    # spawn normally re-runs the parent's __main__ script in the child. Ranks never need it (fn
    # arrives by value), and a user script without an `if __name__ == "__main__"` guard would
    # launch ranks recursively, so drop those entries from spawn's preparation data.
    original = mp.spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        for key in ("init_main_from_name", "init_main_from_path"):
            data.pop(key, None)
        return data

    with _spawn_lock:
        mp.spawn.get_preparation_data = without_main
        try:
            proc.start()
        finally:
            mp.spawn.get_preparation_data = original


class _Ranks:
    """The processes, pipes and store of one RankGroup; kept apart from it so a finalizer can stop them."""

    def __init__(self):
        self.procs, self.conns, self.store, self.stopped = [], [], None, False

    def stop(self, graceful: bool = True):
        if self.stopped:
            return
        self.stopped = True
        if graceful:  # ask each rank to destroy its group and exit on its own
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("close",)))
                except OSError:
                    pass
            deadline = time.monotonic() + 10.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + _KILL_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.store = None  # drops the TCPStore server


_live: "weakref.WeakSet[RankGroup]" = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's own hook, so it runs before that joins children
def _close_all():
    for group in list(_live):
        group.close()


def _death(rank: int, proc) -> RankError:
    proc.join(_KILL_GRACE_S)  # its pipe may close a moment before the process is gone
    code = proc.exitcode
    how = f"signal {-code}, {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return RankError(rank, f"rank {rank} died ({how})")


class RankGroup:
    """`world_size` long-lived rank processes sharing one process group; run functions on all of them.

    Use as a context manager or call ``close()``. After a rank fails or a run times out, every rank
    is stopped and the group is closed; create a new one to go on.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout: float = 300.0,
                 threads_per_rank: int | None = None):
        self.backend = pick_backend(world_size, backend)
        self.world_size, self.timeout = world_size, float(timeout)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if threads_per_rank is not None and (not isinstance(threads_per_rank, int) or threads_per_rank < 1):
            raise ValueError(f"threads_per_rank must be None or an int >= 1, got {threads_per_rank!r}")
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._ranks = ranks = _Ranks()
        self._finalizer = weakref.finalize(self, ranks.stop)
        _live.add(self)
        # Port 0: the OS picks a free port while the store is bound, so there is no port race.
        ranks.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        # PR_SET_PDEATHSIG fires when the creating *thread* exits, so use it only from the main thread.
        pdeathsig = threading.current_thread() is threading.main_thread()
        ctx = mp.get_context("spawn")
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_rank_main, name=f"tplab-rank-{rank}", args=(
                    rank, world_size, self.backend, ranks.store.port, self.timeout, threads, there,
                    os.getpid(), pdeathsig))
                _start_without_main(proc)
                there.close()  # so a dead rank shows up as EOF on our end
                ranks.procs.append(proc)
                ranks.conns.append(here)
            self._collect(self.timeout)  # wait until every rank has joined the group
        except BaseException:
            self._abort()
            raise

    def run(self, fn, args=(), kwargs=None, timeout: float | None = None) -> list:
        """Call ``fn(*args, **kwargs)`` in every rank; return the per-rank results in rank order."""
        if self._ranks.stopped:
            raise RuntimeError("this RankGroup is closed (close() was called, or a rank failed or timed out); "
                               "create a new RankGroup")
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))  # pickling errors leave us usable
        try:
            for rank, conn in enumerate(self._ranks.conns):
                try:
                    conn.send_bytes(pickle.dumps(("call", payload)))
                except OSError:
                    raise _death(rank, self._ranks.procs[rank]) from None
            return self._collect(self.timeout if timeout is None else timeout)
        except BaseException:  # a failure, a timeout or Ctrl-C: no rank may be left half-way through
            self._abort()
            raise

    def _collect(self, timeout: float) -> list:
        """Relay output and gather one reply per rank; raise on the first failure or at the deadline."""
        ranks, results, pending = self._ranks, [None] * self.world_size, set(range(self.world_size))
        deadline = time.monotonic() + timeout

        def handle(rank, msg):
            if msg[0] == "out":
                stream = sys.stdout if msg[1] == "stdout" else sys.stderr
                stream.write("".join(f"[rank {rank}] {line}" for line in msg[2].splitlines(keepends=True)))
                stream.flush()
            elif msg[0] == "ok":
                results[rank] = cloudpickle.loads(msg[1])
                pending.discard(rank)
            else:
                _, name, text, tb = msg
                raise RankError(rank, f"rank {rank} failed: {name}: {text}", tb)

        owner = {c: r for r, c in enumerate(ranks.conns)} | {p.sentinel: r for r, p in enumerate(ranks.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(pending)} did not answer within {timeout:g} s; "
                                   f"all {self.world_size} ranks were stopped")
            for ready in wait([ranks.conns[r] for r in pending] + [p.sentinel for p in ranks.procs], left):
                rank = owner[ready]
                conn = ranks.conns[rank]
                while conn.poll():  # an exited rank may still have its traceback buffered: read it first
                    try:
                        msg = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise _death(rank, ranks.procs[rank]) from None
                    handle(rank, msg)
                if ready is not conn:  # its process exited
                    raise _death(rank, ranks.procs[rank])
        return results

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
    with RankGroup(world_size, backend=backend, timeout=timeout) as group:
        return group.run(fn, args, kwargs)
