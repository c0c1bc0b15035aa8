"""Tensor-parallel bookkeeping: who am I, how many of us, and the collectives TP needs (all-reduce,
all-gather; reduce-scatter for sequence parallelism), and send/recv between pipeline stages.

Layers take ``tp_rank``/``tp_size`` explicitly so that one process can build every rank's shard (tests and
notebooks do); left as ``None`` they come from this stage's TP group, as inside a rank started by
``tplab.launch`` or ``torchrun``. How collectives travel (shared memory between CPU ranks of one host, else
the process group) is decided once per group by ``init_tp_comm()`` or ``init_model_parallel(t, p)``.
``count_collectives()`` records the collectives a block of code runs (notebook 00 counts a decode step's).
"""
import atexit
import contextlib
import gc
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplab.distributed.shm_comm import ShmComm, shm_applies


@dataclass(frozen=True)
class Layout:
    """How this process's ranks are arranged: ``pp_size`` stages of ``tp_size`` TP ranks each, world rank
    ``pp_rank * tp_size + tp_rank`` (vLLM's layout), and how this stage's TP collectives travel."""
    world: object                # the dist.group.WORLD it was decided for: a new process group makes it stale
    group: object                # this stage's TP group (WORLD at PP 1; None at TP 1, which runs no collective)
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    comm: ShmComm | None = None  # shared memory between the group's ranks, where it applies


# Kept beside torch.distributed's own state of the group: it belongs to the process group (set once by
# init_tp_comm / init_model_parallel, checked against it at every collective), not to an LLM.
_layout: Layout | None = None
_release_registered = False        # _release_at_exit runs at exit once the process has had a layout
_recorders: list[list] = []       # the lists of the open count_collectives() blocks; usually empty


def current_layout() -> Layout | None:
    """The layout decided for the current process group, or None (then the world is one TP group)."""
    layout = _layout
    if layout is None or layout.world is not dist.group.WORLD:
        return None
    return layout


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank ran: what, on which tensor, along which path, and how long it took."""
    op: str                      # "all_reduce", "all_gather", "reduce_scatter"; "send"/"recv" between stages
    shape: tuple[int, ...]       # the tensor this rank put in, e.g. (1, hidden) for a decode step's all-reduce
    dtype: torch.dtype
    path: str                    # "shm" (shared memory) or the process group's backend, e.g. "gloo"
    seconds: float               # wall time on this rank, waiting for the slowest rank included

    @property
    def nbytes(self) -> int:
        """Bytes this rank put in."""
        return math.prod(self.shape) * self.dtype.itemsize


@contextlib.contextmanager
def count_collectives():
    """Record every ``all_reduce``/``all_gather``/``reduce_scatter`` over more than one rank, and every ``send``/``recv``
    between pipeline stages, that this process runs inside the ``with``; yields the list of ``CollectiveRecord`` it fills, in call order. Blocks may nest.
    Outside any block the collectives pay one check of an empty list."""
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def _recorded(op: str, x: torch.Tensor, comm, run, *args):
    start = time.perf_counter()
    out = run(*args)
    path = "shm" if comm is not None else str(dist.get_backend())
    record = CollectiveRecord(op, tuple(x.shape), x.dtype, path, time.perf_counter() - start)
    for records in _recorders:
        records.append(record)
    return out


def tp_rank_and_size(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """Fill in whichever of ``tp_rank``/``tp_size`` is None from this stage's TP group (the process group's
    rank and size at PP 1), or 0/1 without a group."""
    layout = current_layout()
    if layout is not None:
        group_rank, group_size = layout.tp_rank, layout.tp_size
    else:
        group_rank, group_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tp_rank = group_rank if tp_rank is None else tp_rank
    tp_size = group_size if tp_size is None else tp_size
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    return tp_rank, tp_size


def pp_rank_and_size() -> tuple[int, int]:
    """This process's pipeline stage and the number of stages (0, 1 without pipeline parallelism)."""
    layout = current_layout()
    return (layout.pp_rank, layout.pp_size) if layout is not None else (0, 1)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, refusing to silently drop a remainder."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _tp_group(tp_size: int) -> tuple[object, Layout | None]:
    """The process group a collective over ``tp_size`` ranks runs on, and the layout it belongs to."""
    layout = current_layout()
    if layout is not None and layout.tp_size == tp_size:
        return layout.group, layout
    # A layer built for tp_size > 1 in a process without a matching group would otherwise
    # return a partial sum that looks like a real activation. One built for the whole world runs over it
    # (ranks kept between checks may have run a pipeline before: its stages' groups do not match then).
    if dist.is_initialized() and dist.get_world_size() == tp_size:
        return None, None
    have = (f"a TP group of {layout.tp_size}" if layout is not None else
            f"a process group of {dist.get_world_size()}" if dist.is_initialized() else "no process group")
    raise RuntimeError(
        f"a collective over tp_size={tp_size} ranks needs a process group of that size (found {have}); "
        "run inside tplab.launch / torchrun, or build the layer with reduce_results=False / "
        "gather_output=False and combine the shards yourself")


def _set_layout(layout: Layout) -> None:
    global _layout, _release_registered
    if not _release_registered:
        atexit.register(_release_at_exit)
        _release_registered = True
    _layout = layout


def _release_at_exit() -> None:
    """At interpreter exit, while Python is still whole: let go of the layout (its TP groups, its shared memory)
    and collect what the engines left in cycles (the requests of their last sends). A gloo group that is still
    alive when the interpreter finalises can abort the rank (SIGABRT, "terminate called without an active
    exception") after its work is done, which under torchrun leaves the other machine's ranks waiting."""
    global _layout
    _layout = None
    gc.collect()


def init_tp_comm(use_shm: bool = True) -> None:
    """Decide how this process group's collectives travel, with the whole world as one TP group: shared
    memory when every rank is a CPU rank on this machine (``shm_comm.shm_applies``), else the process
    group. Every rank must call it (it maps a segment together); a second call for the same group does nothing."""
    layout = current_layout()
    if layout is not None and layout.pp_size == 1:
        return
    comm = ShmComm() if use_shm and shm_applies() else None
    _set_layout(Layout(dist.group.WORLD, dist.group.WORLD, dist.get_rank(), dist.get_world_size(), comm=comm))


def init_model_parallel(tp_size: int, pp_size: int = 1, use_shm: bool = True) -> Layout:
    """Arrange the world's ``tp_size * pp_size`` ranks in ``pp_size`` stages of ``tp_size`` TP ranks (world
    rank = ``pp_rank * tp_size + tp_rank``, as vLLM's): one TP group per stage, made by every rank in the same
    order (``dist.new_group`` is collective), each with its own shared-memory segment where it applies. At
    PP 1 the world is the TP group (``init_tp_comm``). Every rank must call it; again with the same sizes, it
    does nothing."""
    world = dist.get_world_size()
    if tp_size * pp_size != world:
        raise ValueError(f"tensor_parallel_size={tp_size} x pipeline_parallel_size={pp_size} = "
                         f"{tp_size * pp_size} ranks, but the process group has {world}")
    if pp_size == 1:
        init_tp_comm(use_shm)
        return current_layout()
    layout = current_layout()
    if layout is not None and (layout.tp_size, layout.pp_size) == (tp_size, pp_size):
        return layout
    rank = dist.get_rank()
    pp_rank, tp_rank, group = rank // tp_size, rank % tp_size, None
    if tp_size > 1:                                # at TP 1 a stage runs no collective: no group to make
        for stage in range(pp_size):
            made = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            group = made if stage == pp_rank else group
    comm = ShmComm(group) if group is not None and use_shm and shm_applies(group) else None
    _set_layout(Layout(dist.group.WORLD, group, tp_rank, tp_size, pp_rank, pp_size, comm))
    return _layout


def _collective(name: str, impl, x: torch.Tensor, tp_size: int, *args) -> torch.Tensor:
    """Run collective ``impl(x, comm, group, *args)`` over the TP ranks (``x`` itself at tp_size 1), through
    shared memory where it applies, recorded when ``count_collectives`` is watching."""
    if tp_size == 1:
        return x
    group, layout = _tp_group(tp_size)
    comm = layout.comm if layout is not None and layout.comm is not None and layout.comm.fits(x) else None
    if _recorders:
        return _recorded(name, x, comm, impl, x, comm, group, *args)
    return impl(x, comm, group, *args)


def _shm_for(x: torch.Tensor) -> ShmComm | None:
    """The shared-memory communicator a collective on ``x`` would take, if any (tests ask)."""
    layout = current_layout()
    return layout.comm if layout is not None and layout.comm is not None and layout.comm.fits(x) else None


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (no-op at tp_size 1)."""
    return _collective("all_reduce", _all_reduce, x, tp_size)


def _all_reduce(x: torch.Tensor, comm: ShmComm | None, group=None) -> torch.Tensor:
    if comm is not None:
        return comm.all_reduce(x)
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (identity at tp_size 1)."""
    return _collective("all_gather", _all_gather, x, tp_size, tp_size, dim)


def _all_gather(x: torch.Tensor, comm: ShmComm | None, group, tp_size: int, dim: int) -> torch.Tensor:
    if comm is not None:
        return comm.all_gather(x, dim)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, tp_size: int, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the TP ranks and return this rank's chunk of the sum: ``x.shape[dim] / tp_size`` rows
    of ``dim``, rank r the r-th (identity at tp_size 1). ``x.shape[dim]`` must divide by ``tp_size``."""
    if tp_size > 1 and x.shape[dim] % tp_size:
        raise ValueError(f"reduce_scatter: dim {dim} of {tuple(x.shape)} is not divisible by tp_size {tp_size}; "
                         "pad it to a multiple first")
    return _collective("reduce_scatter", _reduce_scatter, x, tp_size, tp_size, dim)


def _reduce_scatter(x: torch.Tensor, comm: ShmComm | None, group, tp_size: int, dim: int) -> torch.Tensor:
    if comm is not None:
        return comm.reduce_scatter(x, dim)
    chunks = [c.contiguous() for c in x.chunk(tp_size, dim)]     # chunk r goes to rank r (gloo and nccl)
    out = torch.empty_like(chunks[dist.get_rank(group)])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def isend(x: torch.Tensor, dst: int):
    """Start sending ``x`` to world rank ``dst`` (point to point, between pipeline stages); returns the
    request to ``wait()`` on before ``x`` may change. Recorded as op "send" when counted."""
    if _recorders:
        return _recorded("send", x, None, dist.isend, x.contiguous(), dst)
    return dist.isend(x.contiguous(), dst)


def recv(x: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into ``x`` from world rank ``src``, waiting until it arrives; returns ``x``. Recorded as op
    "recv" when counted (its time includes the wait: a pipeline bubble)."""
    if _recorders:
        _recorded("recv", x, None, dist.recv, x, src)
    else:
        dist.recv(x, src)
    return x
