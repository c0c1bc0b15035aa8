"""tplab.distributed.launcher: rank processes with a real process group, driven from the parent (gloo on CPU).
Its failures (a rank raising, killed, hanging, Ctrl-C, the parent killed) are in test_dist_failures.py."""
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import live_children
from tplab.distributed.launcher import RankGroup, launch, pick_backend, rank_device, world_info


def api_example_work(x):
    import torch.distributed as dist
    t = torch.full((2,), float(dist.get_rank() + 1)) * x
    dist.all_reduce(t)
    return t


@pytest.fixture(scope="module")
def children_before_this_module():
    """Processes other test modules' fixtures may still hold; none of them is ours."""
    return live_children()


@pytest.fixture(scope="module")
def group2(children_before_this_module):
    with RankGroup(2, timeout=60) as group:
        yield group
    assert live_children() <= children_before_this_module


def test_api_example_returns_summed_tensors_per_rank_in_order(no_new_children):
    results = launch(api_example_work, world_size=2, args=(10.0,), backend=None, timeout=120)
    assert len(results) == 2
    for t in results:
        assert torch.equal(t, torch.tensor([30.0, 30.0]))
        assert not t.is_shared()  # pickled by value, not through shared memory


def test_closure_defined_in_the_test_runs_in_every_rank(group2):
    offset = 100

    def local_work(base, scale=1):
        rank, size = world_info()
        return (base + rank + offset) * scale, size

    assert group2.run(local_work, args=(1,), kwargs={"scale": 2}) == [(202, 2), (204, 2)]


def test_results_come_back_on_cpu_inside_nested_containers(group2):
    def nested():
        t = torch.arange(6.0).view(2, 3)[1]  # a view into a bigger storage
        return {"a": [t, (t * 2,)], "b": rank_device().type}

    for out in group2.run(nested):
        assert out["b"] == "cpu"
        assert torch.equal(out["a"][0], torch.tensor([3.0, 4.0, 5.0]))
        assert torch.equal(out["a"][1][0], torch.tensor([6.0, 8.0, 10.0]))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_launch_all_reduce_returns_per_rank_results_in_order(world_size, no_new_children):
    def work():
        import torch.distributed as dist
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), t.item()

    total = float(sum(range(world_size)))
    assert launch(work, world_size, timeout=60) == [(r, world_size, "gloo", total) for r in range(world_size)]


def test_each_rank_gets_its_share_of_cores_and_one_interop_thread(group2):
    expected = max(1, os.cpu_count() // 2)
    assert group2.run(lambda: (torch.get_num_threads(), torch.get_num_interop_threads())) == [(expected, 1)] * 2


def test_threads_per_rank_overrides_the_default():
    with RankGroup(1, threads_per_rank=3, timeout=60) as group:  # the default here would be cpu_count
        assert group.run(torch.get_num_threads) == [3]


def test_reused_group_keeps_module_state_between_runs(group2):
    def set_state():
        import tplab.distributed.launcher as d
        d._test_state = world_info()[0] * 10
        return os.getpid()

    def get_state():
        import tplab.distributed.launcher as d
        return d._test_state, os.getpid()

    pids = group2.run(set_state)
    assert group2.run(get_state) == [(0, pids[0]), (10, pids[1])]


def test_rank_print_is_forwarded_with_rank_prefix(group2, capsys):
    def talk():
        rank = world_info()[0]
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        print("no newline", end="")

    group2.run(talk)
    captured = capsys.readouterr()
    assert "[rank 0] hello from 0\n" in captured.out
    assert "[rank 1] hello from 1\n" in captured.out
    assert "[rank 1] no newline\n" in captured.out
    assert "[rank 1] warning from 1\n" in captured.err


def test_rank_output_reaches_the_parent_while_the_rank_is_still_running(group2, monkeypatch):
    writes = []

    class Recorder:
        def write(self, text):
            writes.append((time.monotonic(), text))

        def flush(self):
            pass

    def print_then_work():
        print("early")
        time.sleep(1.0)

    monkeypatch.setattr(sys, "stdout", Recorder())
    group2.run(print_then_work)
    done = time.monotonic()
    monkeypatch.undo()
    early = [t for t, text in writes if "early" in text]
    assert len(early) == 2 and max(early) < done - 0.5


def test_each_group_spawns_fresh_processes_with_its_own_store_port(group2, monkeypatch):
    import tplab.distributed.launcher
    monkeypatch.setattr(tplab.distributed.launcher, "_set_in_parent_only", True, raising=False)
    with RankGroup(1, timeout=60) as group:
        assert group._ranks.store.port != group2._ranks.store.port
        assert group.run(lambda: hasattr(sys.modules["tplab.distributed.launcher"], "_set_in_parent_only")) == [False]


def test_ranks_see_the_environment_of_the_moment_they_start(group2, monkeypatch):
    """Ranks are forked from a server started earlier (on Linux), yet they get the caller's current
    environment, as spawned ones would: a variable set after the first launch reaches the next ranks."""
    monkeypatch.setenv("TPLAB_TEST_MARK", "set after the first launch")
    assert launch(lambda: os.environ.get("TPLAB_TEST_MARK"), 2, timeout=60) == ["set after the first launch"] * 2


def test_unpicklable_function_is_refused_in_the_parent_and_group_stays_usable(group2):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock'"):
        group2.run(lambda: lock)
    assert group2.run(world_info) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an int >= 1"),
    (dict(world_size=2.0), "world_size must be an int >= 1"),
    (dict(world_size=2, backend="mpi"), "backend must be one of"),
])
def test_invalid_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pick_backend(**kwargs)
    with pytest.raises(ValueError, match=message):
        launch(world_info, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without enough GPUs")
def test_nccl_without_gpus_explains_how_to_fix_it():
    with pytest.raises(ValueError, match=r"0 GPU\(s\).*backend='gloo' or a smaller world_size"):
        RankGroup(2, backend="nccl")
    assert pick_backend(2) == "gloo"


def test_outside_a_rank_there_is_no_group():
    assert world_info() == (0, 1)
    assert rank_device() == torch.device("cpu")


def test_close_destroys_each_rank_group_and_leaves_no_processes(group2, tmp_path, children_before_this_module):
    def note_destroy(folder):
        import torch.distributed as dist
        original = dist.destroy_process_group

        def destroy(*args, **kwargs):
            Path(folder, f"destroyed{dist.get_rank()}").touch()
            return original(*args, **kwargs)
        dist.destroy_process_group = destroy

    group2.run(note_destroy, args=(str(tmp_path),))
    procs = group2._ranks.procs
    group2.close()
    group2.close()  # idempotent
    assert sorted(os.listdir(tmp_path)) == ["destroyed0", "destroyed1"]
    assert [p.exitcode for p in procs] == [0, 0]  # exited on their own, not terminated
    assert group2._ranks.store is None
    with pytest.raises(RuntimeError, match="closed"):
        group2.run(world_info)
    assert live_children() <= children_before_this_module
