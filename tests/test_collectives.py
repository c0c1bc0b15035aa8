"""The layers whose forward communicates, run in real gloo ranks against the dense layer."""
import pytest
import torch
from torch import nn

from tplab import launch


def _row_embed_head(vocab):
    """In each rank: row-parallel linear (all-reduce), vocab embedding (all-reduce), LM head (all-gather)."""
    import torch.distributed as dist
    from tplab.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(0)  # the same dense weights and inputs in every rank
    dense, emb, x = nn.Linear(24, 16), torch.randn(vocab, 16), torch.randn(5, 24)
    ids = torch.arange(vocab).flip(0)
    row = RowParallelLinear(24, 16, bias=True)
    row.weight_loader(row.weight, dense.weight.detach())
    row.weight_loader(row.bias, dense.bias.detach())
    embed, head = VocabParallelEmbedding(vocab, 16), ParallelLMHead(vocab, 16)
    embed.weight_loader(embed.weight, emb)
    head.weight_loader(head.weight, emb)
    r, n = dist.get_rank(), dist.get_world_size()
    return {
        "row": (row(x.chunk(n, -1)[r]) - dense(x)).abs().max().item(),
        "embed": (embed(ids) - emb[ids]).abs().max().item(),
        "head": (head(x[:, :16]) - x[:, :16] @ emb.T).abs().max().item(),
        "head_shape": tuple(head(x[:, :16]).shape),
    }


@pytest.mark.parametrize("tp,vocab", [(2, 32), (2, 31), (4, 30)])
def test_collective_layers_match_dense_in_real_ranks(tp, vocab):
    for rank, r in enumerate(launch(_row_embed_head, tp, args=(vocab,), backend="gloo", timeout=120)):
        assert r["row"] < 1e-5 and r["embed"] == 0 and r["head"] < 1e-5, f"rank {rank}: {r}"
        assert r["head_shape"] == (5, vocab)                        # padding dropped after the gather


def test_row_parallel_without_a_group_refuses_instead_of_returning_a_partial_sum():
    from tplab.layers import RowParallelLinear
    layer = RowParallelLinear(8, 4, tp_rank=0, tp_size=2)
    with pytest.raises(RuntimeError, match="needs a process group"):
        layer(torch.randn(2, 4))


def _shm_against_gloo():
    """The shared-memory collectives against gloo's, on small and slot-overflowing tensors."""
    import torch.distributed as dist
    from tplab.distributed.parallel_state import all_gather, all_reduce, reduce_scatter
    from tplab.distributed import parallel_state
    from tplab.distributed.shm_comm import SLOT_BYTES

    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(r)
    worst = 0.0
    with parallel_state.count_collectives() as records:              # which path each of tplab's calls took
        for shape in [(1, 64), (3, 896), (SLOT_BYTES // 4 + 10,)]:  # the last one goes through gloo
            for _ in range(20):                                      # reuse both buffers many times
                x = torch.randn(shape)
                ref = x.clone()
                dist.all_reduce(ref)
                worst = max(worst, (all_reduce(x.clone(), n) - ref).abs().max().item())
        g = torch.full((2, 3), float(r))
        gathered = all_gather(g, n, dim=-1)
        with torch.inference_mode():            # the engine's forward runs in inference mode, a notebook's cell
            inside = all_reduce(torch.ones(2, 5), n).clone()    # not: the same shape, both ways round
        sums = [inside, all_reduce(torch.ones(2, 5), n), all_reduce(torch.ones(5, 2).t(), n)]   # the last strided
        y = torch.randn(8, 12)
        total = y.clone()
        dist.all_reduce(total)                                       # gloo's sum; rank r keeps its chunk of it
        scattered = max((reduce_scatter(y.clone(), n, dim=d) - total.chunk(n, d)[r]).abs().max().item()
                        for d in (0, 1))
    paths = sorted({(rec.op, rec.shape, rec.path) for rec in records})
    return worst, gathered, paths, sums, scattered


@pytest.mark.parametrize("tp", [2, 4])
def test_shared_memory_collectives_match_gloo(tp):
    from tplab.distributed.shm_comm import SLOT_BYTES
    for worst, gathered, paths, sums, scattered in launch(_shm_against_gloo, tp, timeout=120):
        assert worst < 1e-5 and scattered < 1e-5
        shm = [("all_reduce", (1, 64)), ("all_reduce", (3, 896)), ("all_reduce", (2, 5)), ("all_gather", (2, 3)),
               ("reduce_scatter", (8, 12))]
        assert paths == sorted([(op, shape, "shm") for op, shape in shm]
                               + [("all_reduce", (SLOT_BYTES // 4 + 10,), "gloo")]), paths
        assert [tuple(s.shape) for s in sums] == [(2, 5)] * 3 and all(torch.equal(s, torch.full((2, 5), float(tp)))
                                                                      for s in sums), sums
        assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(tp)], -1))


def _shm_where():
    """In a rank: whether shared memory applies here, on an Arm machine, and where there is no /dev/shm (a Mac)."""
    import os
    import platform
    from unittest import mock
    from tplab.distributed.shm_comm import shm_applies
    here = shm_applies()
    with mock.patch.object(platform, "machine", lambda: "arm64"):
        arm = shm_applies()
    isdir = os.path.isdir
    with mock.patch.object(os.path, "isdir", lambda p: p != "/dev/shm" and isdir(p)):
        no_dev_shm = shm_applies()
    return here, arm, no_dev_shm


def test_shared_memory_applies_on_x86_linux_only():
    """Its waits rely on x86's store ordering and its segment lives in /dev/shm: an Arm machine or a Mac takes
    gloo (before, an Intel Mac would have failed to open its segment)."""
    assert launch(_shm_where, 2, timeout=120) == [(True, False, False)] * 2


def _mismatched_call(case):
    """Rank 1 calls something other than rank 0 at the same step, through shared memory; then both go on."""
    import torch.distributed as dist
    from tplab.distributed.parallel_state import _shm_for, all_gather, all_reduce
    r = dist.get_rank()
    x = {"shape": torch.ones(3 - r, 4), "dtype": torch.ones(3, 4, dtype=[torch.float32, torch.bfloat16][r]),
         "op": torch.ones(3, 4)}[case]
    assert _shm_for(x) is not None                                   # the path that could sum it silently
    try:
        all_gather(x, 2) if case == "op" and r == 1 else all_reduce(x, 2)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["shape", "dtype", "op"])
def test_shared_memory_refuses_ranks_that_call_different_collectives(case):
    """gloo aborts the rank on such a mismatch; shared memory would sum (or gather) whatever overlaps. Every rank
    says what each rank called."""
    said = launch(_mismatched_call, 2, args=(case,), timeout=60)
    theirs = {"shape": "all_reduce of a (2, 4) torch.float32", "dtype": "all_reduce of a (3, 4) torch.bfloat16",
              "op": "all_gather of a (3, 4) torch.float32"}[case]
    assert said[0] == said[1] == ("the ranks of this group called different collectives at the same step: rank(s) [0] "
                                  f"all_reduce of a (3, 4) torch.float32 tensor; rank(s) [1] {theirs} tensor. Every "
                                  "rank must call the same collectives, in the same order, with tensors of the same "
                                  "shape and dtype: a rank that skips one (inside `if tp_rank == 0:`) meets the "
                                  "others' next one"), said


def _traffic_of_its_own(_):
    """Each rank passes the traffic as it counted it alone (a rank's own row only, zeros elsewhere)."""
    import torch.distributed as dist
    from tplab.distributed.parallel_state import all_to_all, init_model_parallel
    init_model_parallel(1, 1, 2)                              # two DP ranks: the experts' group is both
    r = dist.get_rank()
    traffic = [[1, 1], [0, 0]] if r == 0 else [[0, 0], [2, 2]]
    try:
        all_to_all(torch.ones(sum(traffic[r]), 4), traffic)
    except RuntimeError as e:
        return str(e)
    return None


def test_shared_memory_all_to_all_refuses_traffic_that_differs_between_ranks():
    said = launch(_traffic_of_its_own, 2, args=(None,), timeout=60)
    assert said[0] == said[1] and said[0].startswith(
        "the ranks of this group called different collectives at the same step: rank(s) [0] all_to_all of a (4,) "
        "torch.float32 tensor with traffic [[1, 1], [0, 0]]; rank(s) [1] all_to_all of a (4,) torch.float32 tensor "
        "with traffic [[0, 0], [2, 2]]"), said
