"""Tensor-parallel bookkeeping: who am I, how many of us, and the collectives TP needs (all-reduce,
all-gather; reduce-scatter for sequence parallelism), send/recv between pipeline stages, and under data
parallelism the experts' all-to-all over the EP group (``all_to_all``, ``ep_all_gather``, ``dp_any``; every
rank at PP 1, under PP this stage's ranks of every DP rank).

Layers take ``tp_rank``/``tp_size`` explicitly so that one process can build every rank's shard (tests and
notebooks do); left as ``None`` they come from this stage's TP group, as inside a rank started by
``tplab.launch`` or ``torchrun`` (``tplab.distributed.layout`` defines the groups and the ``*_rank_and_size``
readers; they are imported here so that a layer takes everything distributed from this one module, as vLLM's
layers do). How collectives travel (shared memory between CPU ranks of one host, else the process group) is
set up once per group by ``init_tp_comm()`` or ``init_model_parallel(t, p, d)``, and a tensor too big for a
shared-memory slot takes the process group.
``count_collectives()`` records the collectives a block of code runs (notebook 00 counts a decode step's).
"""
import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplab.distributed.layout import (Layout, current_layout, dp_rank_and_size, init_model_parallel,  # noqa: F401 (re-exported)
                                      init_tp_comm, pp_rank_and_size, tp_rank_and_size)
from tplab.distributed.shm_comm import ShmComm

_recorders: list[list] = []       # the lists of the open count_collectives() blocks; usually empty


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank ran: what, on which tensor, along which path, and how long it took."""
    op: str                      # "all_reduce", "all_gather", "reduce_scatter"; "send"/"recv" between stages;
                                 # "all_to_all" (the experts' exchange), "dp_any" (DP ranks' step check: an all-reduce)
    shape: tuple[int, ...]       # the tensor this rank put in, e.g. (B, hidden) for a decode step's all-reduce
    dtype: torch.dtype
    path: str                    # "shm" (shared memory) or the process group's backend, e.g. "gloo"
    seconds: float               # wall time on this rank: on a CPU (gloo, shm) the wait for the slowest rank
                                 # included; under NCCL only the time to queue it (the call returns at once)
    to_others: int | None = None  # all_to_all: the bytes of its rows for other ranks (those for itself stay)

    @property
    def nbytes(self) -> int:
        """Bytes this rank put in."""
        return math.prod(self.shape) * self.dtype.itemsize


@contextlib.contextmanager
def count_collectives():
    """Record every ``all_reduce``/``all_gather``/``reduce_scatter``/``all_to_all`` over more than one rank, and every
    ``send``/``recv`` between pipeline stages, that this process runs inside the ``with``; yields the list of
    ``CollectiveRecord`` it fills, in call order. Blocks may nest. Only what Python calls is seen: a decode step
    replayed as a CUDA graph runs its collectives without Python (``LLM(..., enforce_eager=True)`` counts them).
    Outside any block the collectives pay one check of an empty list."""
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        del _recorders[next(i for i, r in enumerate(_recorders) if r is records)]   # this block's, not an equal one


def _recorded(op: str, x: torch.Tensor, comm, run, *args, to_others: int | None = None):
    start = time.perf_counter()
    out = run(*args)
    path = "shm" if comm is not None else str(dist.get_backend())
    record = CollectiveRecord(op, tuple(x.shape), x.dtype, path, time.perf_counter() - start, to_others)
    for records in _recorders:
        records.append(record)
    return out


def divide(numerator: int, denominator: int, what: str = "size", by: str = "tp_size") -> int:
    """``numerator // denominator``, refusing to silently drop a remainder; ``by`` names the denominator."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by {by} {denominator}")
    return numerator // denominator


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers: the rows each rank takes when they need not divide."""
    return -(-numerator // denominator)


def _tp_group(tp_size: int) -> tuple[object, Layout | None]:
    """The process group a collective over ``tp_size`` ranks runs on, and the layout it belongs to."""
    layout = current_layout()
    if layout is not None and layout.tp_size == tp_size:
        return layout.group, layout
    # A layer built for tp_size > 1 in a process without a matching group would otherwise
    # return a partial sum that looks like a real activation. One built for the whole world runs over it,
    # even where a layout left from an earlier pipeline run in these ranks says otherwise (a RankGroup reused).
    if dist.is_initialized() and dist.get_world_size() == tp_size:
        return None, None
    have = (f"a TP group of {layout.tp_size}" if layout is not None else
            f"a process group of {dist.get_world_size()}" if dist.is_initialized() else "no process group")
    raise RuntimeError(
        f"a collective over tp_size={tp_size} ranks needs a process group of that size (found {have}); "
        "run inside tplab.launch / torchrun, or build the layer with reduce_results=False (call the LM head "
        "with gather_output=False) and combine the shards yourself")


def _collective(name: str, impl, x: torch.Tensor, tp_size: int, *args) -> torch.Tensor:
    """Run collective ``impl(x, comm, group, *args)`` over the TP ranks (``x`` itself at tp_size 1), through
    shared memory where it applies, recorded when ``count_collectives`` is watching."""
    if tp_size == 1:
        return x
    group, layout = _tp_group(tp_size)
    comm = _shm_if_fits(None if layout is None else layout.comm, x)
    if _recorders:
        return _recorded(name, x, comm, impl, x, comm, group, *args)
    return impl(x, comm, group, *args)


def _shm_for(x: torch.Tensor) -> ShmComm | None:
    """The shared-memory communicator a collective on ``x`` would take, if any (tests ask)."""
    layout = current_layout()
    return _shm_if_fits(None if layout is None else layout.comm, x)


def _shm_if_fits(comm: ShmComm | None, x: torch.Tensor) -> ShmComm | None:
    """``comm`` where ``x`` fits its shared-memory slots, else None: the process group carries it."""
    return comm if comm is not None and comm.fits(x) else None


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


def _in_replica(rank: int) -> int:
    """World rank of this DP rank's rank ``rank`` (its world rank at DP 1): pipeline stages talk within a DP rank."""
    layout = current_layout()
    return rank + (layout.replica_start if layout is not None else 0)


def isend(x: torch.Tensor, dst: int):
    """Start sending ``x`` to rank ``dst`` of this DP rank (its world rank at DP 1; point to point, between
    pipeline stages); returns the request to ``wait()`` on before ``x`` may change. Recorded as op "send"."""
    if _recorders:
        return _recorded("send", x, None, dist.isend, x.contiguous(), _in_replica(dst))
    return dist.isend(x.contiguous(), _in_replica(dst))


def recv(x: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into ``x`` from rank ``src`` of this DP rank, waiting until it arrives; returns ``x``. Recorded as
    op "recv" when counted (its time includes the wait: a pipeline bubble)."""
    if _recorders:
        _recorded("recv", x, None, dist.recv, x, _in_replica(src))
    else:
        dist.recv(x, _in_replica(src))
    return x


def broadcast_in_replica(x: torch.Tensor, src: int) -> torch.Tensor:
    """Broadcast ``x`` from rank ``src`` of this DP rank to its every rank (the world, without DP); returns ``x``."""
    layout = current_layout()
    group = layout.replica_group if layout is not None else None
    dist.broadcast(x, src=_in_replica(src), group=group)
    return x


def _ep(ep_size: int) -> Layout:
    """The layout whose expert-parallel group (every rank, under data parallelism) has ``ep_size`` ranks."""
    layout = current_layout()
    if layout is None or layout.ep_group is None or layout.dp_size * layout.tp_size != ep_size:
        raise RuntimeError(f"an exchange over ep_size={ep_size} ranks needs data parallelism set up over them "
                           "(init_model_parallel(t, 1, d) with d x t = ep_size, as LLM(data_parallel_size=d) does)")
    return layout


def ep_all_gather(x: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Every rank's ``x`` over the expert-parallel group, stacked in rank order: ``(ep_size, *x.shape)``."""
    if ep_size == 1:
        return x.unsqueeze(0)
    layout = _ep(ep_size)
    comm = _shm_if_fits(layout.ep_comm, x)
    run = lambda: _all_gather(x.unsqueeze(0), comm, layout.ep_group, ep_size, 0)   # noqa: E731
    return _recorded("all_gather", x, comm, run) if _recorders else run()


def all_to_all(x: torch.Tensor, traffic: list[list[int]]) -> torch.Tensor:
    """The experts' exchange over the expert-parallel group. ``traffic[i][j]``: the rows rank i sends rank j, the
    same matrix on every rank (so that every rank takes the same path). ``x`` ``(sum(traffic[me]), ...)``: this
    rank's rows grouped by destination, in rank order. Returns the rows sent to this rank, ``(sum over i of
    traffic[i][me], ...)``, grouped by source in rank order. ``x`` itself at one rank.

    gloo has ``all_to_all_single`` with split sizes (as NCCL has), so the process group path is that one call;
    CPU ranks of one host exchange through shared memory (``ShmComm.all_to_all``) where every rank's rows fit."""
    if len(traffic) == 1:
        return x
    layout = _ep(len(traffic))
    me = layout.dp_rank * layout.tp_size + layout.tp_rank          # this rank's index in the EP group
    if x.shape[0] != sum(traffic[me]):
        raise ValueError(f"all_to_all: rank {me} has {x.shape[0]} rows, but the traffic sends {traffic[me]}")
    comm = layout.ep_comm if layout.ep_comm is not None and layout.ep_comm.fits_all_to_all(x, traffic) else None
    run = lambda: _all_to_all(x, comm, layout.ep_group, traffic, me)   # noqa: E731
    if not _recorders:
        return run()
    others = (sum(traffic[me]) - traffic[me][me]) * math.prod(x.shape[1:]) * x.element_size()
    return _recorded("all_to_all", x, comm, run, to_others=others)


def _all_to_all(x: torch.Tensor, comm: ShmComm | None, group, traffic: list[list[int]], me: int) -> torch.Tensor:
    if comm is not None:
        return comm.all_to_all(x, traffic)
    received = [row[me] for row in traffic]
    out = x.new_empty((sum(received), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), received, traffic[me], group=group)
    return out


def dp_any(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the EP group, under data parallelism (``flag`` itself without): one
    all-reduce of one number, which the DP ranks run once a step to agree whether any of them has work."""
    layout = current_layout()
    if layout is None or layout.dp_size == 1:
        return flag
    x = torch.tensor([int(flag)], dtype=torch.int64)    # on the CPU: gloo's (under NCCL, the group's gloo side)
    comm = layout.ep_comm
    run = lambda: _all_reduce(x, comm, layout.ep_group)   # noqa: E731
    total = _recorded("dp_any", x, comm, run) if _recorders else run()     # an all-reduce, recorded by its role
    return bool(total.item() > 0)
