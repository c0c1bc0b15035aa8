"""How ``RankGroup`` starts a rank process: never as a plain fork of the caller, which may have touched
CUDA or started OpenMP threads, and never re-running the caller's ``__main__``; and how ``Ranks`` stops them.

On Linux, ranks come from multiprocessing's fork server: one clean process that has imported tplab and
torch once and is forked for every rank, so no rank imports torch again as a spawned one does
(the difference in seconds: docs/performance-journal.md). The server exits when the caller does, and its
ranks with it (PR_SET_PDEATHSIG). A forked rank inherits the server's environment, so it is handed the
caller's current one. Elsewhere (macOS, Windows), spawn. ``TPLAB_START_METHOD=spawn`` makes Linux spawn too,
so the path macOS and Windows take runs (and is tested) here.
"""
import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import pickle
import signal
import sys
import threading
import time

_start_lock = threading.Lock()
KILL_GRACE_S = 2.0                          # SIGTERM -> SIGKILL delay when stopping ranks
START_METHODS = ("spawn", "forkserver")     # what TPLAB_START_METHOD may name


def start_method() -> str:
    """``$TPLAB_START_METHOD`` when set (checked), else the fork server on Linux and spawn elsewhere."""
    chosen = os.environ.get("TPLAB_START_METHOD", "")
    if not chosen:
        return "forkserver" if sys.platform.startswith("linux") else "spawn"
    if chosen not in START_METHODS:
        raise ValueError(f"TPLAB_START_METHOD={chosen!r} is not a way to start ranks: set it to one of "
                         f"{START_METHODS} ('spawn' starts them as macOS and Windows do), or unset it")
    if chosen not in mp.get_all_start_methods():
        raise ValueError(f"TPLAB_START_METHOD={chosen!r}: {sys.platform} cannot start processes that way; "
                         f"it can {mp.get_all_start_methods()}")
    return chosen


def rank_context():
    """The multiprocessing context rank processes start from (``start_method()``)."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["tplab.distributed.rank_process"])
        _ensure_fork_server()
    return ctx


def _ensure_fork_server() -> None:
    """Start the fork server (if it is not running) with OpenMP single-threaded. A process that has run an
    OpenMP parallel region cannot fork children that use more threads: libgomp's thread pool does not survive
    a fork, and the child's first parallel op waits for it forever. With ``OMP_NUM_THREADS=1`` the server
    never starts a pool, whatever its imports run; each rank then sets its own thread count (``rank_main``)
    and starts its own."""
    with _start_lock:
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"        # only the server's: ranks get the caller's environment
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved


def death_watch(ctx) -> tuple[int | None, bool]:
    """``(parent_pid, pdeathsig)`` for ``rank_main``: the process a rank dies with is the one that forks
    it (None: the fork server, whose pid the caller does not know), and whether PR_SET_PDEATHSIG may be
    used. It fires when the forking *thread* exits: the fork server's main thread, which forks every
    rank and lives as long as the server; under spawn, the caller's, so there only from its main thread."""
    if ctx.get_start_method() == "forkserver":
        return None, True
    return os.getpid(), threading.current_thread() is threading.main_thread()


def start(proc) -> None:
    """``proc.start()`` without the caller's ``__main__`` in the child. Spawn and the fork server
    normally re-run the parent's main script there; ranks never need it (their work comes by value),
    and a user script without an ``if __name__ == "__main__"`` guard would start ranks recursively."""
    original = mp.spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    with _start_lock:
        mp.spawn.get_preparation_data = without_main
        try:
            proc.start()
        finally:
            mp.spawn.get_preparation_data = original


@contextlib.contextmanager
def ctrl_c_deferred():
    """A Ctrl-C (SIGINT) that arrives inside the block is delivered when the block ends. Interrupted inside
    ``start``, the fork server has forked a rank whose pid never reached us, and nothing could stop it; after
    the block the caller knows the rank, and stops it. Only the main thread has Python signal handlers."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield                                       # (None: a handler not from Python, which we could not restore)
        return
    arrived = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if arrived:
            signal.raise_signal(signal.SIGINT)      # now to the caller's own handler (KeyboardInterrupt)


class Ranks:
    """The processes, pipes and store of one RankGroup, apart from it so that a finalizer can stop them."""

    def __init__(self):
        self.procs, self.conns, self.stacks, self.store, self.stopped = [], [], [], None, False

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
            self._join(10.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        self._join(KILL_GRACE_S)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns + self.stacks:
            conn.close()
        self.store = None  # shuts the TCPStore server down

    def _join(self, seconds: float):
        deadline = time.monotonic() + seconds
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
