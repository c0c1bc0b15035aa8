"""Ranks and the collectives between them.

``launcher``       ``launch(fn, world_size)`` and ``RankGroup``: rank processes from a notebook cell
``rank_start``     how a rank process starts: from the fork server, or spawned
``rank_process``   what runs inside one of those processes
``layout``         how the ranks are arranged: TP groups, pipeline stages or data-parallel ranks
``parallel_state`` this rank's place in the TP group, the collectives TP needs, and the experts' all-to-all
``shm_comm``       those collectives through shared memory, for CPU ranks on one machine
``stacks``         where each rank was when a call timed out (``RanksDidNotAnswer``)
"""
from tplab.distributed.launcher import RankError, RankGroup, launch

__all__ = ["launch", "RankGroup", "RankError"]
