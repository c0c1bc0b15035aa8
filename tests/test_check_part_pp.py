"""check_part("pipeline_stage", ...): a learner's pipeline stage (its layers, the embedding and head, its KV cache,
the send and receive at the boundary), alone, at the boundary in real ranks and inside the engine at PP 2 against
HF; each usual mistake named; a stub not attempted."""
import sys

import cloudpickle
import pytest
import torch

from tplab.distributed.parallel_state import isend, recv
from tplab.exercises import check_part
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

Stage = define("pipeline_stage")["MyPipelineStage"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stage_written_from_scratch_passes(tp):
    assert Stage.__mro__[1] is object                                  # not a subclass of tplab's
    result = check_part("pipeline_stage", Stage, tensor_parallel_size=tp)
    assert result.ok is True, result.message
    assert "greedy tokens equal HF's" in result.message and f"TP {tp} x PP 2" in result.message


class Stub(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        raise NotImplementedError


class FloorDivision(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        super().__init__(num_layers, pp_rank, pp_size, tp_rank, tp_size)
        per = num_layers // pp_size
        self.layers = self.kv_cache_layers = range(pp_rank * per, (pp_rank + 1) * per)


class HeadEverywhere(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        super().__init__(num_layers, pp_rank, pp_size, tp_rank, tp_size)
        self.has_head = True


class KVEveryLayer(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        super().__init__(num_layers, pp_rank, pp_size, tp_rank, tp_size)
        self.kv_cache_layers = range(num_layers)


class HiddenOnly(Stage):
    def send(self, hidden, residual):
        self._sending = [isend(hidden, self.peer(self.pp_rank + 1))]

    def recv(self, rows, hidden_size, dtype, device):
        hidden = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), self.peer(self.pp_rank - 1))
        return hidden, torch.zeros_like(hidden)


class Swapped(Stage):
    def recv(self, rows, hidden_size, dtype, device):
        hidden, residual = super().recv(rows, hidden_size, dtype, device)
        return residual, hidden


def test_a_stub_is_not_attempted():
    assert check_part("pipeline_stage", Stub).ok is None


@pytest.mark.parametrize("impl,words", [
    (FloorDivision, "belong to no stage"),
    (HeadEverywhere, "belong to the last stage only"),
    (KVEveryLayer, "memory for nothing"),
    (HiddenOnly, "not the residual stream"),
    (Swapped, "swapped"),
])
def test_stage_mistakes_are_named(impl, words):
    result = check_part("pipeline_stage", impl, tensor_parallel_size=1)
    assert result.ok is False and words in result.message, result.message


class PeerWithoutTP(Stage):
    def peer(self, pp_rank):                                           # the stage's index taken for a world rank
        return pp_rank


def test_a_peer_that_forgets_the_tp_ranks_fails_with_where_to_send():
    result = check_part("pipeline_stage", PeerWithoutTP, tensor_parallel_size=2, timeout=20)
    assert result.ok is False and "at the boundary, TP 2 x PP 2" in result.message, result.message
    assert "(pp_rank +/- 1) * tp_size + tp_rank" in result.message or "(s + 1) * tp_size + tp_rank" in result.message


def test_check_engine_leaves_notebook_07s_parts_to_notebook_07():
    """notebook 06's finale, after a Run All of notebook 07: its two parts are left out of the TP engine (the
    region needs sequence parallelism, the stage needs stages) and named as judged there."""
    from tplab.exercises import check_engine
    region_stub = type("Stub", (define("sp_norm_region")["MySequenceParallelNormRegion"],),
                       {"__init__": Stub.__init__})
    result = check_engine({"pipeline_stage": Stub, "sp_norm_region": region_stub})
    assert result.ok is None and "not attempted yet" in result.message, result
    assert "notebook 07's pipeline_stage, sp_norm_region: judged there" in result.message, result
    row = define("row_linear")["MyRowParallelLinear"]          # not ReturnsPartialSums: no SP engine could take it
    region = define("sp_norm_region")["MySequenceParallelNormRegion"]
    result = check_engine({"row_linear": row, "sp_norm_region": region, "pipeline_stage": Stage})
    assert result.ok is True and "judged there" in result.message, result.message


def test_a_pipeline_check_leaves_the_tp_checks_ranks_alone():
    """A pipeline engine sets a t x p layout in its ranks' processes; the TP checks that follow (notebook 07 run
    twice in one kernel) must not inherit it: they run in other ranks."""
    region = define("sp_norm_region")["MySequenceParallelNormRegion"]
    assert check_part("pipeline_stage", Stage, tensor_parallel_size=1).ok is True
    result = check_part("sp_norm_region", region, tensor_parallel_size=2)
    assert result.ok is True, result.message
