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


def _diagnose_weights(name: str, impl, tp: int = 2):
    spec = spec_of(name)
    return DIAGNOSE[name](spec, [run_probe(impl, spec, r, tp, forward=False) for r in range(tp)], tp)


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
