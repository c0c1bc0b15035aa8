"""How this process's ranks are arranged, decided once per process group: TP groups, pipeline stages or
data-parallel ranks, and how each group's collectives travel (shared memory between CPU ranks of one host, else
the process group).

World rank ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank`` (vLLM's order): each DP rank is a replica
of ``pp_size`` stages, each stage a TP group of its own. Under data parallelism an MoE layer's experts are
spread over every rank that holds the layer: the ranks of one stage in every DP rank, the expert-parallel (EP)
group its all-to-all runs over (the world, without PP). ``tp_rank_and_size``/``pp_rank_and_size``/
``dp_rank_and_size`` read this rank's place; ``parallel_state`` runs the collectives over the groups kept here.
"""
import atexit
import gc
from dataclasses import dataclass

import torch.distributed as dist

from tplab.distributed.shm_comm import ShmComm, shm_applies


@dataclass(frozen=True)
class Layout:
    """How this process's ranks are arranged: ``dp_size`` data-parallel ranks of ``pp_size`` stages of ``tp_size``
    TP ranks each, and how this TP group's collectives (and under DP, the EP group's) travel."""
    world: object                # the dist.group.WORLD it was decided for: a new process group makes it stale
    group: object                # this stage's TP group (WORLD at PP 1 and DP 1; None at TP 1, which runs no collective)
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    comm: ShmComm | None = None  # shared memory between the group's ranks, where it applies
    dp_rank: int = 0
    dp_size: int = 1
    ep_group: object = None      # under DP: this stage's ranks of every DP rank (the experts' all-to-all); else None
    ep_comm: ShmComm | None = None   # shared memory between the EP group's ranks, where it applies
    replica_group: object = None     # under DP with PP: this DP rank's p t ranks (the sampled tokens' broadcast)

    @property
    def replica_start(self) -> int:
        """World rank of this DP rank's first rank: a pipeline peer's world rank is its rank at DP 1 plus this."""
        return self.dp_rank * self.pp_size * self.tp_size


# Kept beside torch.distributed's own state of the group: it belongs to the process group (set once by
# init_tp_comm / init_model_parallel, checked against it at every collective), not to an LLM.
_layout: Layout | None = None
_release_registered = False        # _release_at_exit runs at exit once the process has had a layout


def current_layout() -> Layout | None:
    """The layout decided for the current process group, or None (then the world is one TP group)."""
    layout = _layout
    if layout is None or layout.world is not dist.group.WORLD:
        return None
    return layout


def tp_rank_and_size(tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """Fill in whichever of ``tp_rank``/``tp_size`` is None from this stage's TP group (the process group's
    rank and size at PP 1 and DP 1), or 0/1 without a group."""
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


def dp_rank_and_size(dp_rank: int | None = None, dp_size: int | None = None) -> tuple[int, int]:
    """Fill in whichever of ``dp_rank``/``dp_size`` is None from this process's data-parallel rank (0, 1 without
    data parallelism)."""
    layout = current_layout()
    rank, size = (layout.dp_rank, layout.dp_size) if layout is not None else (0, 1)
    dp_rank, dp_size = rank if dp_rank is None else dp_rank, size if dp_size is None else dp_size
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    return dp_rank, dp_size


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


def _plain(layout: Layout | None) -> bool:
    """Whether ``layout`` is ``init_tp_comm``'s: the whole world one TP group."""
    return layout is not None and layout.pp_size == 1 and layout.dp_size == 1


def init_tp_comm(use_shm: bool = True) -> None:
    """Decide how this process group's collectives travel, with the whole world as one TP group: shared
    memory when every rank is a CPU rank on this machine (``shm_comm.shm_applies``), else the process
    group. Every rank must call it (it maps a segment together); a second call for the same group does nothing."""
    if _plain(current_layout()):
        return
    comm = ShmComm() if use_shm and shm_applies() else None
    _set_layout(Layout(dist.group.WORLD, dist.group.WORLD, dist.get_rank(), dist.get_world_size(), comm=comm))


def init_model_parallel(tp_size: int, pp_size: int = 1, dp_size: int = 1, use_shm: bool = True) -> Layout:
    """Arrange the world's ``dp_size * pp_size * tp_size`` ranks as ``dp_size`` data-parallel ranks of ``pp_size``
    stages of ``tp_size`` TP ranks (world rank ``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``, as vLLM's):
    one TP group each, made by every rank in the same order (``dist.new_group`` is collective), each with its
    own shared-memory segment where it applies; under data parallelism an EP group per stage (the world at PP
    1) and, with PP, a group per DP rank. At PP 1 and DP 1 the world is the TP group (``init_tp_comm``). Every
    rank must call it; again with the same sizes, it does nothing."""
    world = dist.get_world_size()
    if tp_size * pp_size * dp_size != world:
        raise ValueError(f"data_parallel_size={dp_size} x pipeline_parallel_size={pp_size} x tensor_parallel_size="
                         f"{tp_size} = {tp_size * pp_size * dp_size} ranks, but the process group has {world}")
    if pp_size == dp_size == 1:
        init_tp_comm(use_shm)
        return current_layout()
    old = current_layout()
    if old is not None and (old.tp_size, old.pp_size, old.dp_size) == (tp_size, pp_size, dp_size):
        return old
    rank = dist.get_rank()
    outer, tp_rank = rank // tp_size, rank % tp_size          # outer: dp_rank * pp_size + pp_rank
    dp_rank, pp_rank = divmod(outer, pp_size)
    group = _mine([range(g * tp_size, (g + 1) * tp_size) for g in range(dp_size * pp_size)], outer) \
        if tp_size > 1 else None                  # at TP 1 a stage runs no collective: no group to make
    comm = ShmComm(group) if group is not None and use_shm and shm_applies(group) else None
    ep_group = ep_comm = replica_group = None
    if dp_size > 1 and pp_size == 1:             # the experts' exchange: every rank, the world's segment
        ep_group = dist.group.WORLD
        ep_comm = old.comm if _plain(old) and use_shm else ShmComm() if use_shm and shm_applies() else None
    elif dp_size > 1:                            # one EP group per stage, one group per DP rank
        replica = pp_size * tp_size
        ep_group = _mine([[d * replica + s * tp_size + t for d in range(dp_size) for t in range(tp_size)]
                          for s in range(pp_size)], pp_rank)
        ep_comm = ShmComm(ep_group) if use_shm and shm_applies(ep_group) else None
        replica_group = _mine([range(d * replica, (d + 1) * replica) for d in range(dp_size)], dp_rank)
    _set_layout(Layout(dist.group.WORLD, group, tp_rank, tp_size, pp_rank, pp_size, comm, dp_rank, dp_size,
                       ep_group, ep_comm, replica_group))
    return _layout


def _mine(groups: list, index: int):
    """Make every one of ``groups`` (lists of world ranks; every rank makes them all, in the same order) and
    return the ``index``-th."""
    made = [dist.new_group(list(ranks)) for ranks in groups]
    return made[index]
