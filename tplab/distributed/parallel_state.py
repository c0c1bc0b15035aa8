"""Tensor-parallel bookkeeping: who am I, how many of us, and the collectives TP needs (all-reduce and
all-gather; reduce-scatter for sequence parallelism, ``tplab.models.sequence_parallel``).

Layers take ``tp_rank``/``tp_size`` explicitly so that one process can build every
rank's shard (tests and notebooks do this). When they are left as ``None`` they come
from the default process group, as they would inside a rank started by
``tplab.launch`` or ``torchrun``.

How the collectives travel is decided once per process group, by ``init_tp_comm()``:
a rank started by ``tplab.launch`` calls it as it joins the group, an engine under
``torchrun`` as it starts. Without it they go through the process group itself.

``count_collectives()`` records the collectives a block of code runs (op, shape, path, time);
notebook 00 counts one decode step's with it.
"""
import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplab.distributed.shm_comm import ShmComm, shm_applies

# A cache of the process group's communicator, kept beside torch.distributed's own state of the group:
# it belongs to the group (set once by init_tp_comm, checked against it at every collective), not to an LLM.
_tp_comm: ShmComm | None = None   # the shared-memory communicator of _tp_comm_group, where it applies
_tp_comm_group = None             # the process group init_tp_comm() decided for
_recorders: list[list] = []       # the lists of the open count_collectives() blocks; usually empty


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective this rank ran: what, on which tensor, along which path, and how long it took."""
    op: str                      # "all_reduce", "all_gather" or "reduce_scatter"
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
    """Record every ``all_reduce``/``all_gather``/``reduce_scatter`` over more than one rank that this process runs inside
    the ``with``; yields the list of ``CollectiveRecord`` it fills, in call order. Blocks may nest.
    Outside any block the collectives pay one check of an empty list."""
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def _recorded(op: str, x: torch.Tensor, comm, run, *args) -> torch.Tensor:
    start = time.perf_counter()
    out = run(*args)
    path = "shm" if comm is not None else str(dist.get_backend())
    record = CollectiveRecord(op, tuple(x.shape), x.dtype, path, time.perf_counter() - start)
    for records in _recorders:
        records.append(record)
    return out


def tp_rank_and_size(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """Fill in whichever of ``tp_rank``/``tp_size`` is None from the process group (or 0/1 without one)."""
    group_rank, group_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tp_rank = group_rank if tp_rank is None else tp_rank
    tp_size = group_size if tp_size is None else tp_size
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    return tp_rank, tp_size


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, refusing to silently drop a remainder."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _check_group(tp_size: int) -> None:
    # A layer built for tp_size > 1 in a process without a group would otherwise
    # return a partial sum that looks like a real activation.
    if not dist.is_initialized() or dist.get_world_size() != tp_size:
        have = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise RuntimeError(
            f"a collective over tp_size={tp_size} ranks needs a process group of that size (found {have}); "
            "run inside tplab.launch / torchrun, or build the layer with reduce_results=False / "
            "gather_output=False and combine the shards yourself")


def init_tp_comm(use_shm: bool = True) -> None:
    """Decide how this process group's collectives travel: shared memory when every rank is a CPU
    rank on this machine (``shm_comm.shm_applies``), else the process group. Every rank must call it
    (it maps a segment together); a second call for the same group does nothing."""
    global _tp_comm, _tp_comm_group
    if _tp_comm_group is dist.group.WORLD:
        return
    _tp_comm = ShmComm() if use_shm and shm_applies() else None
    _tp_comm_group = dist.group.WORLD


def _shm_for(x: torch.Tensor) -> ShmComm | None:
    if _tp_comm is None or _tp_comm_group is not dist.group.WORLD or not _tp_comm.fits(x):
        return None
    return _tp_comm


def _collective(name: str, impl, x: torch.Tensor, tp_size: int, *args) -> torch.Tensor:
    """Run collective ``impl(x, comm, *args)`` over the TP ranks (``x`` itself at tp_size 1), through shared
    memory where it applies, recorded when ``count_collectives`` is watching."""
    if tp_size == 1:
        return x
    _check_group(tp_size)
    comm = _shm_for(x)
    if _recorders:
        return _recorded(name, x, comm, impl, x, comm, *args)
    return impl(x, comm, *args)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place (no-op at tp_size 1)."""
    return _collective("all_reduce", _all_reduce, x, tp_size)


def _all_reduce(x: torch.Tensor, comm: ShmComm | None) -> torch.Tensor:
    if comm is not None:
        return comm.all_reduce(x)
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (identity at tp_size 1)."""
    return _collective("all_gather", _all_gather, x, tp_size, tp_size, dim)


def _all_gather(x: torch.Tensor, comm: ShmComm | None, tp_size: int, dim: int) -> torch.Tensor:
    if comm is not None:
        return comm.all_gather(x, dim)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, tp_size: int, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the TP ranks and return this rank's chunk of the sum: ``x.shape[dim] / tp_size`` rows
    of ``dim``, rank r the r-th (identity at tp_size 1). ``x.shape[dim]`` must divide by ``tp_size``."""
    if tp_size > 1 and x.shape[dim] % tp_size:
        raise ValueError(f"reduce_scatter: dim {dim} of {tuple(x.shape)} is not divisible by tp_size {tp_size}; "
                         "pad it to a multiple first")
    return _collective("reduce_scatter", _reduce_scatter, x, tp_size, tp_size, dim)


def _reduce_scatter(x: torch.Tensor, comm: ShmComm | None, tp_size: int, dim: int) -> torch.Tensor:
    if comm is not None:
        return comm.reduce_scatter(x, dim)
    chunks = [c.contiguous() for c in x.chunk(tp_size, dim)]     # chunk r goes to rank r (gloo and nccl)
    out = torch.empty_like(chunks[dist.get_rank()])
    dist.reduce_scatter(out, chunks)
    return out
