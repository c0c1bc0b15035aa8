"""The notebook 00 checker passes the reference ring all-reduce and names each usual mistake, in real ranks."""
import pytest
import torch
from torch.distributed import all_reduce

from tplab.exercises import nb00
from tplab.exercises.solutions import define
from tplab.exercises.watchdog import STRAGGLE_S

ring_all_reduce = define("ring_all_reduce")["ring_all_reduce"]      # the reference solution

WORLD3 = (3,)       # most mistakes show at 3 ranks; one launch per test keeps the file quick


def ring(x, order="right", gather="copy"):
    """The ring with one switchable mistake: the reduce-scatter's chunk order, or the all-gather's add/skip."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    flat = x.reshape(-1).clone()
    chunks = list(flat.tensor_split(world))
    for step in range(world - 1):
        send, recv = {"right": ((rank - step) % world, (rank - step - 1) % world),
                      "forward": ((rank + step) % world, (rank + step - 1) % world),   # walks the ring backwards
                      "same": ((rank - step) % world, (rank - step) % world)}[order]  # adds into the wrong chunk
        incoming = torch.empty_like(chunks[recv])
        request = dist.isend(chunks[send].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        chunks[recv] += incoming
    if gather == "none":
        return flat.view_as(x)
    for step in range(world - 1):
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        if gather == "into_sent":                            # overwrites the chunk it just sent
            recv = send
        incoming = torch.empty_like(chunks[recv])
        request = dist.isend(chunks[send].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        chunks[recv].add_(incoming) if gather == "add" else chunks[recv].copy_(incoming)
    return flat.view_as(x)


def test_ring_all_reduce_solution_passes_at_3_and_2_ranks():
    result = nb00.check_ring_all_reduce(ring_all_reduce)
    assert result.ok is True, result
    assert "world sizes 3, 2" in result.message


def test_the_test_ring_without_a_mistake_passes():
    result = nb00.check_ring_all_reduce(ring, world_sizes=WORLD3)
    assert result.ok is True, result


def test_stub_is_not_attempted_without_starting_ranks():
    def stub(x):
        raise NotImplementedError
    result = nb00.check_ring_all_reduce(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_returning_none_asks_about_return():
    def forgot(x):
        ring_all_reduce(x)
    result = nb00.check_ring_all_reduce(forgot, world_sizes=WORLD3)
    assert result.ok is False and "returned None: did you forget `return`?" in result.message


def test_missing_all_gather_is_named():
    result = nb00.check_ring_all_reduce(lambda x: ring(x, gather="none"), world_sizes=WORLD3)
    assert result.ok is False and "the all-gather phase is missing" in result.message, result


def test_summing_twice_is_named():
    result = nb00.check_ring_all_reduce(lambda x: ring(x, gather="add"), world_sizes=WORLD3)
    assert result.ok is False and "summed twice" in result.message, result


def test_wrong_chunk_order_in_the_reduce_scatter_is_named():
    for order in ("forward", "same"):
        result = nb00.check_ring_all_reduce(lambda x: ring(x, order=order), world_sizes=WORLD3)
        assert result.ok is False and "the chunk order is off" in result.message, (order, result)


def test_all_gather_into_the_wrong_chunk_is_named():
    result = nb00.check_ring_all_reduce(lambda x: ring(x, gather="into_sent"), world_sizes=WORLD3)
    assert result.ok is False and "the chunks are out of order" in result.message, result


def test_nothing_exchanged_is_named():
    result = nb00.check_ring_all_reduce(lambda x: x, world_sizes=WORLD3)
    assert result.ok is False and "nothing was sent" in result.message


def test_calling_a_collective_is_refused_by_name():
    def lazy(x):
        import torch.distributed as dist
        dist.all_reduce(x)
        return x
    result = nb00.check_ring_all_reduce(lazy, world_sizes=WORLD3)
    assert result.ok is False and "called the collective all_reduce" in result.message


def test_a_collective_imported_by_name_or_through_tplab_is_refused():
    """A cell's ``from torch.distributed import all_reduce`` is pickled by reference: the ranks must load it
    under the spies; tplab's own collectives go through shared memory, not ``torch.distributed``."""
    def imported(x):
        all_reduce(x)
        return x

    def tplabs(x):
        import torch.distributed as dist
        from tplab.distributed.parallel_state import all_reduce as tp_all_reduce
        return tp_all_reduce(x.clone(), dist.get_world_size())
    result = nb00.check_ring_all_reduce(imported, world_sizes=(2,))
    assert result.ok is False and "called the collective all_reduce" in result.message, result
    result = nb00.check_ring_all_reduce(tplabs, world_sizes=(2,))
    assert result.ok is False and "called the collective all_reduce" in result.message, result


def test_a_flattened_result_is_refused_with_the_fix():
    result = nb00.check_ring_all_reduce(lambda x: ring_all_reduce(x).reshape(-1), world_sizes=WORLD3)
    assert result.ok is False and "view_as(x)" in result.message


def test_an_exception_names_the_rank_and_the_line():
    def fails_on_rank_1(x):
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("chunk sizes differ")
        return ring_all_reduce(x)
    result = nb00.check_ring_all_reduce(fails_on_rank_1, world_sizes=WORLD3)
    assert result.ok is False and "rank 1 failed: ValueError: chunk sizes differ" in result.message
    assert "line 4 of fails_on_rank_1" in result.message


def test_sends_and_recvs_that_never_pair_up_time_out_with_a_hint():
    def both_right(x):                                   # receives from the right too: nobody sends that way
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        incoming = torch.empty_like(x)
        dist.isend(x.contiguous(), (rank + 1) % world)
        dist.recv(incoming, (rank + 1) % world)
        return x + incoming
    result = nb00.check_ring_all_reduce(both_right, world_sizes=WORLD3, timeout=10)
    assert result.ok is False and "never comes" in result.message


def test_a_rank_that_returns_early_is_named_with_where_the_others_wait():
    """Rank 0 skips the ring; the others wait in a recv for it. Stopped soon after rank 0 returned, not at the
    timeout (60 s here), with the line each waiting rank is at."""
    def rank_0_leaves(x):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            return x
        incoming = torch.empty_like(x)
        dist.recv(incoming, (dist.get_rank() - 1) % dist.get_world_size())
        return x + incoming
    result = nb00.check_ring_all_reduce(rank_0_leaves, world_sizes=WORLD3, timeout=60)
    assert result.ok is False and (f"rank(s) [1, 2] had not ended {STRAGGLE_S:.0f} s after rank(s) [0] had returned"
                                   in result.message)
    assert "in rank_0_leaves: `dist.recv(incoming, " in result.message and "never comes" in result.message, result


def test_a_float64_result_names_the_dtype_it_should_keep():
    result = nb00.check_ring_all_reduce(lambda x: ring_all_reduce(x).double(), world_sizes=WORLD3)
    assert result.ok is False and "returned torch.float64, but x is torch.float32" in result.message, result.message


def test_a_collective_on_one_rank_only_is_named_at_once_not_timed_out():
    def rank_0_reduces(x):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            dist.all_reduce(x)                           # the other ranks never join: it would wait forever
        return ring_all_reduce(x)
    result = nb00.check_ring_all_reduce(rank_0_reduces, world_sizes=WORLD3, timeout=30)
    assert result.ok is False and "rank 0 called the collective all_reduce" in result.message, result.message
    assert "line 4 of rank_0_reduces" in result.message, result.message


def test_fit_alpha_beta_recovers_a_line_and_falls_back_to_alpha_alone():
    import numpy as np
    from tplab.exercises.links import fit_alpha_beta
    n = np.array([4 << (2 * k) for k in range(10)], dtype=float)
    alpha, beta = fit_alpha_beta(n, 20e-6 + n / 5e9)                   # notebook 00's shared-memory figures
    assert abs(alpha / 20e-6 - 1) < 1e-6 and abs(beta / 5e9 - 1) < 1e-6
    alpha, beta = fit_alpha_beta(list(n), [3e-4, 1e-4] * 5)            # no size dependence: alpha alone
    assert beta == float("inf") and abs(alpha - np.sqrt(3e-4 * 1e-4)) < 1e-12


def whole_tensor_ring(x):
    """Passes all of x round the ring, adding what arrives: the right sum, at (world - 1) times x per rank."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    total, passing = x.clone(), x.clone()
    for _ in range(world - 1):
        incoming = torch.empty_like(passing)
        request = dist.isend(passing, (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        total += incoming
        passing = incoming
    return total


def one_step_too_many(x):
    """world reduce-scatter steps, not world - 1: the extra sum is overwritten by the all-gather, the traffic is not."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = x.reshape(-1).clone()
    chunks = list(flat.tensor_split(world))
    for phase, steps in (("reduce", world), ("gather", world - 1)):
        for step in range(steps):
            send, recv = ((rank - step) % world, (rank - step - 1) % world) if phase == "reduce" else \
                ((rank + 1 - step) % world, (rank - step) % world)
            incoming = torch.empty_like(chunks[recv])
            request = dist.isend(chunks[send].contiguous(), (rank + 1) % world)
            dist.recv(incoming, (rank - 1) % world)
            request.wait()
            chunks[recv].add_(incoming) if phase == "reduce" else chunks[recv].copy_(incoming)
    return flat.view_as(x)


@pytest.mark.parametrize("fn, sent", [(whole_tensor_ring, "sent 24 values, 2.00 times x"),
                                      (one_step_too_many, "sent 20 values, 1.67 times x")])
def test_a_right_sum_that_sends_more_than_the_ring_is_refused(fn, sent):
    result = nb00.check_ring_all_reduce(fn, world_sizes=WORLD3)
    assert result.ok is False and "the sum is right" in result.message and sent in result.message, result.message
    assert "2 (world - 1) / world = 1.33 times x" in result.message, result.message


def test_a_sum_assigned_to_a_new_tensor_is_told_to_add_in_place():
    def rebinds(x):
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        flat = x.reshape(-1).clone()
        chunks = list(flat.tensor_split(world))
        for phase in ("reduce", "gather"):
            for step in range(world - 1):
                send, recv = ((rank - step) % world, (rank - step - 1) % world) if phase == "reduce" else \
                    ((rank + 1 - step) % world, (rank - step) % world)
                incoming = torch.empty_like(chunks[recv])
                request = dist.isend(chunks[send].contiguous(), (rank + 1) % world)
                dist.recv(incoming, (rank - 1) % world)
                request.wait()
                if phase == "reduce":
                    chunks[recv] = chunks[recv] + incoming       # a new tensor: flat never sees the sum
                else:
                    chunks[recv].copy_(incoming)
        return flat.view_as(x)
    result = nb00.check_ring_all_reduce(rebinds, world_sizes=WORLD3)
    assert result.ok is False and "never reached the tensor you return" in result.message, result.message
    assert "add in place (chunks[i] += incoming" in result.message and "all-gather phase" not in result.message


def test_blocking_sends_on_every_rank_time_out_naming_isend():
    def sends_first(x):
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        incoming = torch.empty_like(x)
        dist.send(x.contiguous(), (rank + 1) % world)          # every rank waits here for a recv nobody posts
        dist.recv(incoming, (rank - 1) % world)
        return x + incoming
    result = nb00.check_ring_all_reduce(sends_first, world_sizes=WORLD3, timeout=10)
    assert result.ok is False and "A blocking dist.send on every rank" in result.message, result.message
    assert "dist.isend, then dist.recv, then wait()" in result.message
