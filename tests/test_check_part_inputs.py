"""check_part on what its probes once let through or misjudged: a part wrong only on one row (a decode step of one
sequence), a notebook whose default dtype is float64, an output on another device, a rank that dies without an
exception."""
import sys

import cloudpickle
import pytest
import torch

from tplab.exercises import check_part
from tplab.exercises.solutions import PARTS, define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

Row, Embedding = define("row_linear")[PARTS["row_linear"]], define("embedding")[PARTS["embedding"]]


class DecodeShortcut(Row):
    """Skips the all-reduce for a lone row, as if one decode token needed none: every longer input is right."""
    def forward(self, x):
        return x @ self.weight.T + self.bias if x.shape[0] == 1 else super().forward(x)


class SqueezedIds(Embedding):
    """Squeezes the ids: one id becomes a 0-d tensor, which the mask's [:, None] cannot index."""
    def forward(self, input_ids):
        return super().forward(input_ids.squeeze())


@pytest.mark.parametrize("name, impl, words", [
    ("row_linear", DecodeShortcut, "at TP 2 on one row (a decode step of one sequence, the T == 1 that one prompt "
                                   "alone gives), rank 0: returned its own partial sum plus the bias: no all-reduce"),
    ("embedding", SqueezedIds, "at TP 1 on one row (a decode step of one sequence, the T == 1 that one prompt "
                               "alone gives): raised IndexError")])
def test_a_part_wrong_only_on_one_row_is_named(name, impl, words):
    result = check_part(name, impl)      # the engine's TP 2 decode batches two prompts: only the probe has T == 1
    assert result.ok is False and words in result.message, result.message


@pytest.mark.parametrize("name", ["row_linear", "embedding", "sp_norm_region"])
def test_a_notebook_default_dtype_of_float64_does_not_fail_a_right_part(name):
    """The checks make their inputs with the default dtype, here and in ranks that start with float32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        result = check_part(name, define(name)[PARTS[name]])
        assert torch.get_default_dtype() == torch.float64                  # the notebook's, given back
    finally:
        torch.set_default_dtype(before)
    assert result.ok is True, result.message


class MetaOutput(Row):
    def forward(self, x):
        return super().forward(x).to("meta")


class Rank1Exits(Row):
    def forward(self, x):
        import os
        if self.tp_rank == 1:
            os._exit(1)
        return super().forward(x)


@pytest.mark.parametrize("impl, words", [
    (MetaOutput, "the layer alone at TP 1: forward's output is on device meta, but the engine runs this layer on cpu"),
    (Rank1Exits, "at TP 2, rank 1 died (exit code 1): it ended without a Python exception")])
def test_an_output_on_another_device_or_a_rank_that_dies_is_said_as_such(impl, words):
    result = check_part("row_linear", impl)
    assert result.ok is False and words in result.message, result.message
