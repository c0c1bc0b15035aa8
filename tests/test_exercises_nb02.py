"""The notebook 02 checker accepts the reference shard and names what is wrong with plausible mistakes."""
import pytest
import torch

from tplab.exercises import nb02
from tplab.exercises.solutions import define

SOLUTION = define("shard")["shard"]


def test_check_shard_accepts_the_solution():
    result = nb02.check_shard(SOLUTION)
    assert result.ok is True and "correct" in repr(result)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_solution_equals_the_loaded_layer_weight(kind):
    weight = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for rank in range(4):
        assert torch.equal(SOLUTION(weight, rank, 4, kind), nb02.reference_shard(weight, rank, 4, kind))


def test_check_shard_reports_a_stub_as_not_attempted():
    def stub(weight, rank, tp, kind):
        raise NotImplementedError
    result = nb02.check_shard(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_check_shard_rejects_swapped_dimensions():
    def swapped(weight, rank, tp, kind):                 # column on dim 1, row on dim 0
        return weight.chunk(tp, dim=1 if kind == "column" else 0)[rank]
    result = nb02.check_shard(swapped)
    assert result.ok is False and "nn.Linear.weight is (out_features, in_features)" in result.message


def test_check_shard_rejects_the_students_dim1_narrow_reshaped_into_rows():
    def dim1(weight, rank, tp, kind):
        if kind == "row":
            return SOLUTION(weight, rank, tp, kind)
        rows, cols = weight.shape[0] // tp, weight.shape[1] // tp
        return weight.narrow(1, rank * cols, cols).reshape(rows, weight.shape[1])
    result = nb02.check_shard(dim1)
    assert result.ok is False and "shard_dim1" in result.message


def test_check_shard_rejects_the_wrong_rank():
    result = nb02.check_shard(lambda w, rank, tp, kind: SOLUTION(w, tp - 1 - rank, tp, kind))
    assert result.ok is False and "rank 0 of tp 2" in result.message


def test_check_shard_reports_a_crash_as_wrong_not_as_an_exception():
    result = nb02.check_shard(lambda w, rank, tp, kind: w.chunk(tp, dim={"column": 0}[kind])[rank])
    assert result.ok is False and "raised KeyError" in result.message


def test_check_shard_names_a_float64_shard():
    result = nb02.check_shard(lambda w, rank, tp, kind: SOLUTION(w, rank, tp, kind).double())
    assert result.ok is False and "torch.float64, but the weight is torch.float32" in result.message, result.message
