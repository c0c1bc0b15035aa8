"""tplab.distributed.launcher when ranks fail: a rank raising, killed or hanging, Ctrl-C in the parent, the parent
killed, and a survivor's connection error; each leaves no process behind (gloo on CPU)."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tplab.distributed.launcher import RankError, RankGroup, launch, world_info


def test_raising_rank_gives_rank_error_quickly_and_next_launch_works(no_new_children):
    def fail_on_rank_1():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("boom on purpose")
        dist.barrier()  # rank 0 waits for a peer that never comes
        return "unreachable"

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fail_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 20
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed: ValueError: boom on purpose" in str(err)
    assert "Traceback (most recent call last)" in err.remote_traceback
    assert "fail_on_rank_1" in str(err) and 'raise ValueError("boom on purpose")' in str(err)
    assert launch(lambda: world_info(), 2, timeout=60) == [(0, 2), (1, 2)]


def test_killed_rank_gives_rank_error_quickly_and_closes_group(no_new_children):
    def die_on_rank_1():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    group = RankGroup(2, timeout=60)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died \(signal 9") as info:
        group.run(die_on_rank_1)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    with pytest.raises(RuntimeError, match="create a new RankGroup"):
        group.run(world_info)
    group.close()  # idempotent after a failure


def test_hanging_rank_times_out_naming_the_silent_ranks(no_new_children):
    def hang_on_rank_0():
        if world_info()[0] == 0:
            time.sleep(3600)
        return "done"

    with RankGroup(2, timeout=60) as group:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[0\] did not answer within 1.5 s"):
            group.run(hang_on_rank_0, timeout=1.5)
        assert time.monotonic() - start < 1.5 + 4  # + SIGTERM grace and joins


def test_straggle_stops_ranks_left_behind_by_one_that_answered(no_new_children):
    """A rank that has answered never joins the collective the other waits in: with ``straggle`` that is said
    seconds after the first answer, not at the timeout; a rank merely a little late is waited for."""
    def hang_on_rank_0(late_s):
        if world_info()[0] == 0:
            time.sleep(late_s)
        return "done"

    with RankGroup(2, timeout=60) as group:
        assert group.run(hang_on_rank_0, (0.5,), straggle=5) == ["done", "done"]
        with pytest.raises(ValueError, match="straggle must be a positive number"):
            group.run(hang_on_rank_0, (0.0,), straggle=0)
        with pytest.raises(TimeoutError) as info:
            group.run(hang_on_rank_0, (3600,), timeout=600, straggle=1)
    assert "ranks [0] did not answer within 1 s of the first answer" in str(info.value)
    assert info.value.stragglers().startswith("rank(s) [0] had not ended 1 s after rank(s) [1] had returned; "
                                              "where each was: rank 0 at "), info.value.stragglers()


def test_ctrl_c_while_waiting_stops_the_ranks_and_reraises(no_new_children, sigint_raises):
    group = RankGroup(2, timeout=60)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        group.run(time.sleep, args=(3600,))
    assert time.monotonic() - start < 1.0 + 4
    with pytest.raises(RuntimeError, match="create a new RankGroup"):
        group.run(world_info)


def test_ctrl_c_while_a_rank_starts_leaves_no_rank_behind(no_new_children, sigint_raises, monkeypatch):
    """Ctrl-C inside ``proc.start()``, after the fork server forked the rank but before its pid came back (a
    notebook's first TP 2 LLM interrupted a second in): the rank is stopped with the others."""
    from tplab.distributed import rank_start
    started = rank_start.start

    def interrupted_while_starting(proc):
        started(proc)
        signal.raise_signal(signal.SIGINT)          # as if the Ctrl-C came just before start() returned
    monkeypatch.setattr(rank_start, "start", interrupted_while_starting)
    before = forked_ranks()                          # the fork server's children: ranks (live_children skips them)
    with pytest.raises(KeyboardInterrupt):
        RankGroup(2, timeout=60)
    assert forked_ranks() <= before


def forked_ranks() -> set[int]:
    servers = [p for p in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return {c.pid for server in servers for c in server.children() if c.is_running() and c.status() != "zombie"}


# A user script with no `if __name__ == "__main__":` guard, whose process is then killed.
USER_SCRIPT = """
import os, threading, time
from tplab.distributed.launcher import RankGroup
main_thread_group = RankGroup(1)  # ranks get PR_SET_PDEATHSIG
box = []
thread = threading.Thread(target=lambda: box.append(RankGroup(1)))  # ranks rely on the watchdog
thread.start()
thread.join()
print(*main_thread_group.run(os.getpid), *box[0].run(os.getpid), flush=True)
time.sleep(3600)
"""


def test_ranks_exit_when_the_parent_is_killed(tmp_path):
    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    pids = []
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, parent.stderr.read() if parent.poll() is not None else line
        assert not any(gone(pid) for pid in pids)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_survivors_connection_error_is_reported_as_the_peers_death(no_new_children, tmp_path):
    """When a rank is killed, its peer's collective fails with a reset connection, and that error can
    reach the driver before the death does: the death is what the error names. Here the error is sent
    first for certain (rank 1 dies only once rank 0 is raising); when the death is noticed first, it is
    reported on its own, which is the other order of the same race."""
    raising = tmp_path / "rank0-raising"

    def die_on_rank_1_reset_on_rank_0():
        import time

        import torch.distributed as dist
        if dist.get_rank() == 1:
            while not raising.exists():
                time.sleep(0.005)
            time.sleep(0.05)                       # rank 0's error is on its way to the driver by now
            os.kill(os.getpid(), signal.SIGKILL)
        raising.touch()
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    with pytest.raises(RankError, match=r"rank 1 died \(signal 9.*then rank 0 failed: RuntimeError") as info:
        RankGroup(2, timeout=60).run(die_on_rank_1_reset_on_rank_0)
    assert info.value.rank == 1


def test_a_timeout_no_clock_can_wait_is_refused_before_anything_starts(no_new_children):
    for timeout in (float("inf"), 1e12, 0, True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds, at most 1e"):
            launch(world_info, 2, timeout=timeout)
    with RankGroup(1, timeout=60) as group:
        with pytest.raises(ValueError, match="at most 1e"):
            group.run(world_info, timeout=float("inf"))
        assert group.run(world_info) == [(0, 1)]                  # refused before it was sent: still usable


def test_a_timeout_says_where_each_rank_was(no_new_children):
    """Rank 1 loops in the caller's code, rank 0 waits for it in a collective: the message names both lines."""
    def loops_on_rank_1():
        import torch.distributed as dist
        while dist.get_rank() == 1:
            pass
        dist.barrier()
    with RankGroup(2, timeout=60) as group:
        with pytest.raises(TimeoutError) as info:
            group.run(loops_on_rank_1, timeout=3)
    message = str(info.value)
    assert "rank 1 at " in message and "in loops_on_rank_1: `while dist.get_rank() == 1:`" in message, message
    assert "rank 0 at " in message and "in loops_on_rank_1: `dist.barrier()`" in message, message


def test_asking_a_rank_that_died_for_its_stack_does_not_wait_on_its_closed_pipe():
    """A rank asked before it registered for the signal dies of it: its pipe is at its end, read as nothing."""
    import multiprocessing
    from tplab.distributed import stacks
    read_end, write_end = multiprocessing.Pipe(duplex=False)
    write_end.close()
    start = time.monotonic()
    assert stacks.where({0: 2 ** 22 + 12345}, {0: read_end}) == ""       # no such pid: nothing is signalled
    assert time.monotonic() - start < 2


def _kv_cache_with_rank_1_short_of_memory(model):
    from types import SimpleNamespace
    from unittest import mock

    import torch
    import torch.distributed as dist
    from tplab.engine import kv_cache
    from tplab.engine.config import engine_config

    cfg = engine_config(model, tensor_parallel_size=2, num_kv_blocks=64)
    short = SimpleNamespace(available=1000) if dist.get_rank() == 1 else psutil.virtual_memory()
    with mock.patch.object(kv_cache.psutil, "virtual_memory", return_value=short):
        try:
            return kv_cache.kv_blocks_per_batch(cfg, kv_cache.kv_cache_spec(cfg), torch.device("cpu"))
        except ValueError as e:
            return str(e)


def test_a_kv_cache_one_rank_cannot_hold_is_refused_on_every_rank(checkpoint, no_new_children):
    """One rank short of memory refuses ``num_kv_blocks``; the others must refuse too, or under ``torchrun`` they
    would wait for it in their first collective until the process group's timeout."""
    said = launch(_kv_cache_with_rank_1_short_of_memory, 2, args=(checkpoint("gqa"),), timeout=120)
    assert all(isinstance(s, str) and "num_kv_blocks=64 makes a KV cache" in s for s in said), said
    assert "more than the 1,000 free: ask for less" in said[1]
    assert "more than the 1,000 free of a rank (this one has " in said[0]
