"""What runs inside a rank process started by ``RankGroup``: join the group, then serve calls from
the parent until it says close (or disappears).

A call is a function sent by value (``RankGroup.run``), or a method of the one object this rank
keeps between calls (``RankGroup.create`` makes it, ``RankGroup.call`` calls it): how an ``LLM``'s
engine lives in its ranks, as a vLLM worker does."""
import ctypes
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from tplab.distributed import stacks
from tplab.distributed.parallel_state import init_tp_comm


class _Forward(io.TextIOBase):
    """A rank's sys.stdout/sys.stderr: ships each complete line to the parent as soon as it is written."""
    encoding, errors = "utf-8", "replace"

    def __init__(self, send, stream: str):
        self._send, self._stream, self._buf, self._lock = send, stream, "", threading.Lock()

    def write(self, text, final=False):
        with self._lock:  # partial lines wait for their newline so "[rank N] " stays at line starts
            head, sep, self._buf = (self._buf + text + "\n" * final).rpartition("\n")
        if sep and (head or not final):
            self._send(("out", self._stream, head + sep))
        return len(text)


def _to_cpu(x):
    """Detached, compact CPU copies of every tensor in nested lists/tuples/dicts, so results pickle by value."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").clone()
    if isinstance(x, dict):
        return type(x)((k, _to_cpu(v)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*map(_to_cpu, x))
    if isinstance(x, (list, tuple)):
        return type(x)(map(_to_cpu, x))
    return x


def _watch_parent(parent_pid: int):
    # Fallback where PR_SET_PDEATHSIG is not used: an orphaned process is re-parented.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _guard_parent(parent_pid: int | None, pdeathsig: bool) -> None:
    """Die with the parent: at once by PR_SET_PDEATHSIG where asked (Linux), else within a second."""
    if pdeathsig and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    parent_pid = parent_pid or os.getppid()
    if os.getppid() != parent_pid or parent_pid == 1:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _join_group(rank: int, world_size: int, backend: str, port: int, timeout_s: float, threads: int) -> None:
    """Join the parent's process group, and decide how collectives travel (``init_tp_comm``)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))  # for code written for torchrun
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    # NCCL takes CUDA tensors only; a GPU group also carries CPU ones (a notebook cell's, the engine's KV
    # budget), so it is NCCL for CUDA tensors and gloo for CPU tensors, in one group
    devices = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    dist.init_process_group(devices, store=store, rank=rank, world_size=world_size, timeout=timeout)
    init_tp_comm()


class _Server:
    """A rank's end of the pipe to its parent: it answers calls, and forwards what the rank prints."""

    def __init__(self, conn):
        self.conn, self.send_lock = conn, threading.Lock()
        self.out, self.err = _Forward(self.send, "stdout"), _Forward(self.send, "stderr")
        self.resident = None  # the object RankGroup.create made here, if any

    def send(self, msg) -> None:
        data = cloudpickle.dumps(msg)
        try:
            with self.send_lock:  # prints may come from any thread
                self.conn.send_bytes(data)
        except OSError:  # the parent is gone
            os._exit(1)

    def answer(self, work) -> bool:
        """Run ``work()`` and send the parent its result or traceback, whatever happens."""
        try:
            reply = ("ok", cloudpickle.dumps(_to_cpu(work())))
        except BaseException as e:
            reply = ("err", type(e).__qualname__, str(e), traceback.format_exc())
        self.out.write("", final=True)
        self.err.write("", final=True)
        self.send(reply)
        return reply[0] == "ok"

    def dispatch(self, kind: str, payload: bytes):
        """One request from the parent, named after the ``RankGroup`` method that sent it (``run``, ``create``,
        ``call``); unpickled inside ``answer``, so a missing module is reported too."""
        fn, args, kwargs = cloudpickle.loads(payload)
        if kind == "call":
            if self.resident is None:
                raise RuntimeError(f"no object to call {getattr(fn, '__qualname__', fn)} on: RankGroup.create() first")
            return fn(self.resident, *args, **kwargs)
        if kind == "create":
            self.resident = None       # free the old one before building the next
            self.resident = fn(*args, **kwargs)
            return None
        return fn(*args, **kwargs)

    def serve(self) -> None:
        """Answer calls until the parent says close or closes the pipe; idle ranks block here."""
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                break
            if msg[0] == "close":
                break
            self.answer(lambda msg=msg: self.dispatch(*msg))
        self.resident = None


def rank_main(rank, world_size, backend, port, timeout_s, threads, conn, stack_out, parent_pid, pdeathsig, environ):
    """Entry point of a rank process (module level, so spawn finds it without the user's __main__).
    ``parent_pid``: the process that started this one, which it dies with (None: whichever forked it,
    the fork server); ``environ``: the caller's environment when it started the rank."""
    os.environ.clear()
    os.environ.update(environ)
    _guard_parent(parent_pid, pdeathsig)
    stacks.answer_when_asked(stack_out)           # asked when the parent gives up waiting
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    server = _Server(conn)
    sys.stdout, sys.stderr = server.out, server.err
    if server.answer(lambda: _join_group(rank, world_size, backend, port, timeout_s, threads)):
        server.serve()
    if dist.is_initialized():
        dist.destroy_process_group()
