"""The part checks' diagnoses of loaded weights (``layer_diagnoses``), in this process: every rank's shard is built
and loaded by ``run_probe`` without a process group, so a loading mistake is named without starting ranks."""
import pytest
import torch
from torch.utils import deterministic

from tplab.exercises.layer_diagnoses import DIAGNOSE
from tplab.exercises.layer_probes import empty_is_nan, run_probe, spec_of
from tplab.exercises.solutions import PARTS, define
from tplab.layers import copy_into

Row, Embedding = define("row_linear")[PARTS["row_linear"]], define("embedding")[PARTS["embedding"]]
GateUp, QKV = define("gate_up_linear")[PARTS["gate_up_linear"]], define("qkv_linear")[PARTS["qkv_linear"]]


def _diagnose_weights(name: str, impl, tp: int = 2, forward: bool = False):
    spec = spec_of(name)
    return DIAGNOSE[name](spec, [run_probe(impl, spec, r, tp, forward=forward) for r in range(tp)], tp)


class Rank0Columns(Row):
    """Narrows at offset 0 on every rank: each rank loads rank 0's columns."""
    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:
            return super().weight_loader(param, loaded, shard_id)
        copy_into(param.data, loaded.narrow(1, 0, param.shape[1]))


class Rank0Rows(Embedding):
    """Reads the vocabulary's first rows on every rank: each rank loads rank 0's rows."""
    def weight_loader(self, param, loaded, shard_id=None):
        copy_into(param.data, loaded.narrow(0, 0, self.per_rank))


class PlainTensorBias(Row):
    """Keeps the bias as a plain tensor: it loads, but named_parameters() does not list it."""
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        del self.bias
        self.bias = torch.zeros(output_size)
        self.bias.weight_loader = self.weight_loader


def test_the_right_shards_pass():
    assert _diagnose_weights("row_linear", Row) == (True, "")
    assert _diagnose_weights("embedding", Embedding) == (True, "")


def test_a_shard_narrowed_at_another_ranks_offset_is_named():
    ok, why = _diagnose_weights("row_linear", Rank0Columns)
    assert ok is False and "rank 1: `weight` holds rank 0's shard, not its own" in why, why
    ok, why = _diagnose_weights("embedding", Rank0Rows)
    assert ok is False and "rank 1: `weight` holds rank 0's shard, not its own" in why, why


def test_a_weight_that_is_not_a_parameter_is_named():
    ok, why = _diagnose_weights("row_linear", PlainTensorBias)
    assert ok is False and "`self.bias` is a tensor but not an nn.Parameter" in why, why


class EmptyBiasUnloaded(Row):
    """Makes its bias with torch.empty and never loads it: what it holds is whatever torch.empty gives."""
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        self.bias = torch.nn.Parameter(torch.empty(output_size), requires_grad=False)
        self.bias.weight_loader = lambda param, loaded, shard_id=None: None


def test_what_no_loader_wrote_is_named_as_nan_whatever_memory_held_before():
    bias = spec_of("row_linear").weights[-1][1]
    for _ in range(3):       # tensors holding the checkpoint's bias, freed: torch.empty may hand that memory back
        copies = [bias.clone() for _ in range(8)]
        del copies
        ok, why = _diagnose_weights("row_linear", EmptyBiasUnloaded)
        assert ok is False and why.startswith("rank 0: `bias` holds NaN, torch.empty's values") \
            and why.endswith("never wrote it (the bias is not split: it is added once, in full)"), why


def test_torch_empty_gives_nan_only_while_a_part_is_built():
    before = torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory
    with pytest.raises(RuntimeError, match="from __init__"):
        with empty_is_nan():
            assert torch.empty(4).isnan().all() and not torch.zeros(4).isnan().any()
            raise RuntimeError("from __init__")
    assert (torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory) == before


class PaddingRowsLeftEmpty(Embedding):
    """Makes its (padded) table with torch.empty and loads the real rows only: the rows past the vocabulary, which
    must be zeros, hold whatever torch.empty gave."""
    def __init__(self, num_embeddings, embedding_dim, tp_rank=None, tp_size=None):
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        self.weight = torch.nn.Parameter(torch.empty(self.weight.shape), requires_grad=False)
        self.weight.weight_loader = self.weight_loader


def test_vocabulary_padding_left_to_torch_empty_is_named():
    ok, why = _diagnose_weights("embedding", PaddingRowsLeftEmpty)     # 11 rows over 2 ranks: rank 1 pads one
    assert ok is False and why.startswith("rank 1: part of `weight` holds NaN, torch.empty's values") \
        and "zeros past the real vocabulary" in why, why


class UpOverGate(GateUp):
    """Writes up_proj at the offset where gate_proj went (tp_rank * rows for both): up overwrites gate."""
    def weight_loader(self, param, loaded, shard_id):
        rows = self.local_sizes[shard_id]
        copy_into(param.data.narrow(0, self.tp_rank * rows, rows), loaded.narrow(0, self.tp_rank * rows, rows))


class NoKVHeadAtTP4(QKV):
    """num_kv_heads = total_num_kv_heads // tp_size, without max(1, ...): 0 KV heads a rank at TP 4 of 2 KV heads."""
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=True, tp_rank=None,
                 tp_size=None):
        super().__init__(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias, tp_rank, tp_size)
        self.num_kv_heads = total_num_kv_heads // self.tp_size
        self.kv_size = self.num_kv_heads * head_size
        for name in ("weight", "bias"):
            shape = (self.q_size + 2 * self.kv_size, hidden_size)[:getattr(self, name).dim()]
            setattr(self, name, torch.nn.Parameter(torch.empty(shape), requires_grad=False))
            getattr(self, name).weight_loader = self.weight_loader


class BiasOnRank0(QKV):
    """Adds the bias on rank 0 only, as a row-parallel layer does before its all-reduce."""
    def forward(self, x):
        y = x @ self.weight.T
        return y + self.bias if self.tp_rank == 0 else y


@pytest.mark.parametrize("name, impl, tp, forward, words", [
    ("gate_up_linear", UpOverGate, 1, False, "rows 0-11 hold up_proj's rows 0-11, expected gate_proj's rows 0-11 ([this "
                                             "rank's gate rows | this rank's up rows]); gate and up were written at the "
                                             "same offset"),
    ("gate_up_linear", UpOverGate, 2, False, "gate and up were written at the same offset, up over gate: in the fused "
                                             "rows up starts after this rank's gate rows"),
    ("qkv_linear", NoKVHeadAtTP4, 4, False, "`weight` has shape (4, 8), expected (12, 8) (rows [q heads | k heads | v "
                                            "heads] of this rank); at TP 4 there are fewer KV heads (2) than ranks, so "
                                            "total_num_kv_heads // tp_size is 0: each rank keeps one KV head, a replica, "
                                            "num_kv_heads = max(1, total_num_kv_heads // tp_size)"),
    ("qkv_linear", BiasOnRank0, 4, True, "rank 1: the bias is missing on this rank: added on rank 0 only, as a "
                                         "row-parallel layer does before its all-reduce. A column-parallel layer's bias "
                                         "is sharded with its rows"),
])
def test_column_parallel_loading_and_bias_mistakes_are_named(name, impl, tp, forward, words):
    ok, why = _diagnose_weights(name, impl, tp, forward)
    assert ok is False and words in why, why
    assert _diagnose_weights(name, define(name)[PARTS[name]], tp, forward) == (True, "")
