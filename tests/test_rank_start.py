"""How ranks start (``tplab/distributed/rank_start.py``): the start method ``TPLAB_START_METHOD`` picks, and
ranks forked from the fork server that use more than one thread."""
import pytest

from tplab.distributed import RankGroup, rank_start


def test_the_start_method_is_checked(monkeypatch):
    monkeypatch.setenv("TPLAB_START_METHOD", "fork")
    with pytest.raises(ValueError, match="TPLAB_START_METHOD='fork' is not a way to start ranks: set it to one of"):
        rank_start.rank_context()
    monkeypatch.setenv("TPLAB_START_METHOD", "spawn")
    assert rank_start.rank_context().get_start_method() == "spawn"
    monkeypatch.delenv("TPLAB_START_METHOD")
    assert rank_start.start_method() in ("forkserver", "spawn")


def parallel_ops():
    import torch
    x = torch.ones(512, 512)
    return torch.get_num_threads(), float(torch.zeros(2048, 256).sum()), float((x @ x)[0, 0])


@pytest.mark.parametrize("world_size", [1, 2])
def test_ranks_with_two_threads_each_run_parallel_ops(world_size):
    """What TP 2 gets on a 4-core laptop. The fork server has run oneDNN ops (importing tplab does); had it
    started OpenMP's thread pool, a forked rank's first parallel op would wait for that pool forever."""
    with RankGroup(world_size, backend="gloo", timeout=60, threads_per_rank=2) as group:
        assert group.run(parallel_ops) == [(2, 0.0, 512.0)] * world_size
