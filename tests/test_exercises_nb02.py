"""The notebook 02 checker accepts the reference shard and names what is wrong with plausible mistakes."""
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from tplab.distributed.parallel_state import all_gather, all_reduce
from tplab.exercises import check_part, nb02
from tplab.exercises.solutions import PARTS, define
from tplab.layers import copy_into

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


def _narrow(w, rank, tp, kind, start=lambda rank, size: rank * size):
    dim = 0 if kind == "column" else 1
    size = w.shape[dim] // tp
    return w.narrow(dim, start(rank, size), size)


@pytest.mark.parametrize("fn, words", [
    (lambda w, rank, tp, kind: _narrow(w, rank, tp, kind, lambda r, size: (r + 1) * size),
     "column shard, rank 0 of tp 1: raised RuntimeError: start (12) + length (12) exceeds dimension size (12).: past "
     "the end of the weight; rank r's shard starts at r * size (ranks count from 0)"),
    (lambda w, rank, tp, kind: _narrow(w, rank, tp, kind, lambda r, size: max(r - 1, 0) * size),
     "column shard, rank 1 of tp 2: this is rank 0's shard"),
    (lambda w, rank, tp, kind: w[rank::tp] if kind == "column" else w[:, rank::tp], "every tp-th row (a stride of tp)"),
    (lambda w, rank, tp, kind: SOLUTION(w, rank, tp, kind).T, "transposed; return the shard in the weight's own"),
    (lambda w, rank, tp, kind: w, "column shard, rank 0 of tp 2: the whole weight"),
    (lambda w, rank, tp, kind: w.narrow(0, 0, w.shape[1] // tp) if kind == "column" else SOLUTION(w, rank, tp, kind),
     "shape (8, 8), tplab's layer holds (12, 8): dim 0 is cut in tp pieces of weight.shape[0] // tp = 12"),
])
def test_check_shard_names_more_mistakes(fn, words):
    result = nb02.check_shard(fn)
    assert result.ok is False and words in result.message, result.message


# Notebook 02's part exercises (check_part): the mistakes the layer alone names (the ranks' own endings, with their
# hints: test_check_part_errors.py).
cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the parts below travel to the ranks by value
Row, GateUp, QKV = (define(name)[PARTS[name]] for name in ("row_linear", "gate_up_linear", "qkv_linear"))


class BiasAfterTheSumOnRank0(Row):
    def forward(self, x):
        y = all_reduce(x @ self.weight.T, self.tp_size)
        return y + self.bias if self.bias is not None and self.tp_rank == 0 else y


class GathersPartialSums(Row):
    def forward(self, x):
        y = x @ self.weight.T
        return all_gather(y + self.bias if self.bias is not None and self.tp_rank == 0 else y, self.tp_size)


class TransposedRowWeight(Row):
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        self.weight = torch.nn.Parameter(torch.empty(input_size // self.tp_size, output_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:
            return super().weight_loader(param, loaded, shard_id)
        cols = param.shape[0]
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols).materialize().T)

    def forward(self, x):
        return all_reduce(x @ self.weight + (self.bias if self.tp_rank == 0 else 0), self.tp_size)


class Activates(GateUp):
    def forward(self, x):
        gate, up = (x @ self.weight.T).chunk(2, dim=-1)
        return F.silu(gate) * up


class UpOverGate(GateUp):
    """Copies up_proj's rows to offset 0 too: they overwrite gate's."""
    def weight_loader(self, param, loaded, shard_id):
        rows = self.local_sizes[shard_id]
        copy_into(param.data.narrow(0, 0, rows), loaded.narrow(0, self.tp_rank * rows, rows))


class HeadsNotRows(QKV):
    """Starts at tp_rank * num_heads rows: heads, not times head_size."""
    def weight_loader(self, param, loaded, shard_id):
        rows, offset = {"q": (self.q_size, 0), "k": (self.kv_size, self.q_size),
                        "v": (self.kv_size, self.q_size + self.kv_size)}[shard_id]
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        group = self.tp_rank if shard_id == "q" else self.tp_rank // self.replicas
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, group * heads, rows))


class KQV(QKV):
    def weight_loader(self, param, loaded, shard_id):
        rows = self.q_size if shard_id == "q" else self.kv_size
        offset = {"k": 0, "q": self.kv_size, "v": self.kv_size + self.q_size}[shard_id]
        start = (self.tp_rank if shard_id == "q" else self.tp_rank // self.replicas) * rows
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))


class BiasNotLoaded(QKV):
    def weight_loader(self, param, loaded, shard_id):
        if param.dim() == 2:
            super().weight_loader(param, loaded, shard_id)


@pytest.mark.parametrize("name, impl, tp, words", [
    ("row_linear", BiasAfterTheSumOnRank0, 2, "rank 1: the bias is missing on this rank: added after the all-reduce "
                                              "on rank 0 only"),
    ("row_linear", GathersPartialSums, 2, "returned the ranks' partial sums side by side (all-gather)"),
    ("row_linear", TransposedRowWeight, 2, "yours is transposed: keep the checkpoint's (out, in) layout"),
    ("gate_up_linear", Activates, 2, "returned silu(gate) * up: return the fused [gate | up] output"),
    ("gate_up_linear", UpOverGate, 2, "at TP 1: `weight` rows 0-11 hold up_proj's rows 0-11, expected gate_proj's"),
    ("qkv_linear", HeadsNotRows, 4, "rank 1: `weight` rows 0-3 hold q_proj's rows 1-4, expected q_proj's rows 4-7"),
    ("qkv_linear", KQV, 2, "`weight` rows 0-7 hold k_proj's rows 0-7, expected q_proj's rows 0-7"),
    ("qkv_linear", BiasNotLoaded, 2, "`bias` entries 0-15 hold NaN, torch.empty's values (the checker makes them "
                                     "NaN): the weight_loader never wrote them"),
])
def test_check_part_names_the_notebook_02_parts_mistakes(name, impl, tp, words):
    result = check_part(name, impl, tensor_parallel_size=tp)
    assert result.ok is False and words in result.message, result.message
    assert "sharded on the wrong dimension" not in result.message      # at TP 1 a (2 I, E) weight is not dim 1's
