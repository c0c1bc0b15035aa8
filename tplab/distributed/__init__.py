"""Ranks and the collectives between them.

``launcher``       ``launch(fn, world_size)`` and ``RankGroup``: rank processes from a notebook cell
``rank_process``   what runs inside one of those processes
``parallel_state`` this rank's place in the TP group, and the two collectives TP needs
``shm_comm``       those collectives through shared memory, for CPU ranks on one machine
"""
from tplab.distributed.launcher import RankError, RankGroup, launch

__all__ = ["launch", "RankGroup", "RankError"]
