"""check_part's other endings: a stub is "not attempted", a missing return is named,
the finale names the parts still stubs, and a part that raises or hangs in a rank, or calls a collective
at TP 1 without a group, ends in a clear error."""
import re
import sys

import cloudpickle
import pytest
import torch

from tplab.distributed.parallel_state import all_gather, all_reduce
from tplab.exercises import FORGOT_RETURN, check_engine, check_part
from tplab.exercises.solutions import PARTS, define
from tplab.exercises.watchdog import STRAGGLE_S
from tplab.layers import copy_into

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the parts below travel to the ranks by value

Row, GateUp, Stage, Embedding, LMHead = (define(name)[PARTS[name]] for name in (
    "row_linear", "gate_up_linear", "pipeline_stage", "embedding", "lm_head"))


class Stub(torch.nn.Module):
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__()
        raise NotImplementedError


class ForgetsReturn(Row):
    def forward(self, x):
        super().forward(x)


class RaisesOnRank1(Row):
    def forward(self, x):
        if self.tp_rank == 1:
            raise ValueError("learner bug")
        return super().forward(x)


class HangsOnRank0(Row):
    def forward(self, x):
        if self.tp_size > 1 and self.tp_rank == 0:
            return x.new_zeros(x.shape[0], self.output_size)       # skips the all-reduce rank 1 waits in
        return super().forward(x)


def test_a_stub_is_not_attempted_and_a_missing_return_is_named():
    assert check_part("row_linear", Stub).ok is None
    result = check_part("row_linear", ForgetsReturn)
    assert result.ok is False and result.message.endswith(FORGOT_RETURN.replace("returned", "forward returned")), \
        result.message


def test_the_finale_names_the_parts_still_stubs_and_where_to_write_them():
    result = check_engine({"row_linear": Stub, "gate_up_linear": GateUp})
    assert result.ok is None and "still stubs: row_linear (notebook 02)." in result.message, result.message
    assert "stub above" not in result.message and "`# Exercise:` cells" in result.message


def test_the_notebook_named_for_each_part_holds_its_exercise_cell():
    import json
    from pathlib import Path
    from tplab.exercises.parts import AFTER_TP, NOTEBOOK
    assert set(NOTEBOOK) == set(PARTS) - set(AFTER_TP)                  # every part the finale judges
    for part, number in NOTEBOOK.items():
        (path,) = (Path(__file__).resolve().parents[1] / "notebooks").glob(f"{number}_*.ipynb")
        firsts = {"".join(c["source"]).split("\n")[0] for c in json.loads(path.read_text())["cells"]}
        assert f"# Exercise: {part}" in firsts, (part, path.name)


def test_a_part_that_raises_in_a_rank_names_the_rank_and_line_and_the_next_call_works():
    result = check_part("row_linear", RaisesOnRank1)
    assert result.ok is False and "rank 1 raised ValueError: learner bug" in result.message, result.message
    assert 'raise ValueError("learner bug")' in result.message
    assert check_part("row_linear", Row).ok is True


def test_a_part_that_hangs_is_stopped_soon_after_the_other_rank_returned():
    """...not at the timeout (90 s), and says which rank returned and where the other waits: the learner's line
    with the collective."""
    result = check_part("row_linear", HangsOnRank0)
    assert result.ok is False and "did not finish in time" in result.message, result.message
    assert (f"rank(s) [1] had not ended {STRAGGLE_S:.0f} s after rank(s) [0] had returned; where each was: rank 1 at "
            in result.message), result.message
    assert re.search(r"rank 1 at \S+.*:\d+ in forward", result.message), result.message     # the solution's line


def test_check_engine_names_a_skipped_collective_by_what_each_rank_called_next():
    """check_engine runs no part alone: in the engine's prefill rank 0 skips o_proj's all-reduce, and its next
    collective (the LM head's all-gather) meets rank 1's all-reduce. Shared memory would have paired them."""
    result = check_engine({"row_linear": HangsOnRank0})
    assert result.ok is False and "called different collectives at the same step: rank(s) [0] all_gather of a " \
        "(9, 1024) torch.float32 tensor; rank(s) [1] all_reduce of a (9, 256) torch.float32 tensor" in result.message, \
        result.message


class GathersOnRank1Only(LMHead):
    def forward(self, hidden):
        if self.tp_rank == 0:
            return (hidden @ self.weight.T).repeat(1, self.tp_size)[:, :self.num_embeddings]   # skips the gather
        return super().forward(hidden)


def test_check_engine_stops_a_rank_left_waiting_soon_after_the_other_returned():
    """The LM head's all-gather is a prefill's last collective: rank 0 skips it and returns, rank 1 waits."""
    result = check_engine({"lm_head": GathersOnRank1Only})
    assert result.ok is False and f"rank(s) [1] had not ended {STRAGGLE_S:.0f} s after rank(s) [0] had returned" \
        in result.message, result.message


class CallsDistDirectly(Row):
    """torch.distributed.all_reduce with no guard: fine in ranks, an error at TP 1 in the notebook's process."""
    def forward(self, x):
        import torch.distributed as dist
        y = x @ self.weight.T
        dist.all_reduce(y)
        return y


def test_a_collective_at_tp1_without_a_group_gets_a_hint():
    result = check_part("row_linear", CallsDistDirectly)
    assert result.ok is False and "at TP 1 (in this process) there is no process group" in result.message, \
        result.message
    assert "dist.all_reduce(y)" in result.message                      # the learner's line


class ReturnsBias(Row):
    def forward(self, x):
        return super().forward(x), self.bias


def test_a_forward_that_returns_a_tuple_is_told_what_to_return():
    result = check_part("row_linear", ReturnsBias)                     # not "raised AttributeError: 'tuple' ..."
    assert result.ok is False and "forward returned a tuple, not a tensor: return only the (T, output_size) " \
        "output" in result.message, result.message


class LoopsOnAnOddSplit(Stage):
    def __init__(self, num_layers, *args, **kwargs):
        super().__init__(num_layers, *args, **kwargs)
        while num_layers % 2:                                          # the stages alone try 5 layers
            pass


def test_an_endless_loop_in_a_stage_is_named_not_raised_into_the_cell():
    result = check_part("pipeline_stage", LoopsOnAnOddSplit, tensor_parallel_size=1, timeout=8)
    assert result.ok is False and "did not return within" in result.message, result.message
    assert "LoopsOnAnOddSplit.__init__" in result.message, result.message


class RaisesWhenBuilt:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("built")


@pytest.mark.parametrize("name,impl,tp,words", [
    ("experts", RaisesWhenBuilt, 2, "which has no experts"),
    ("row_linear", Row(8, 4, tp_rank=0, tp_size=1), 2, "pass the class itself (e.g. MyRowParallelLinear)"),
    ("row_linear", Row, "2", "tensor_parallel_size must be a positive int, got '2'"),
    ("row_linear", Row, True, "tensor_parallel_size must be a positive int, got True"),
])
def test_what_no_check_can_judge_is_refused_before_anything_runs(name, impl, tp, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        check_part(name, impl, tensor_parallel_size=tp)


def test_a_static_decode_part_runs_in_the_engine_it_is_checked_in():
    """Not only on CUDA: the check turns static_decode on, so a part that cannot even be built is named."""
    result = check_part("static_decode", RaisesWhenBuilt, tensor_parallel_size=2)
    assert result.ok is False and "RuntimeError: built" in result.message, result.message


class Exits(Row):
    def forward(self, x):
        sys.exit()


def test_a_sys_exit_in_a_part_is_a_verdict_not_the_end_of_the_notebook():
    result = check_part("row_linear", Exits, tensor_parallel_size=2)
    assert result.ok is False and "SystemExit" in result.message, result.message


class NarrowsOneRankOn(Row):
    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:
            return super().weight_loader(param, loaded, shard_id)
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, (self.tp_rank + 1) * cols, cols).materialize())


class UpAtTheFullOffset(GateUp):
    def weight_loader(self, param, loaded, shard_id):
        rows = self.local_sizes[shard_id]
        param.data.narrow(0, shard_id * loaded.shape[0], rows).copy_(loaded.narrow(0, self.tp_rank * rows, rows)
                                                                     .materialize())


class BiasAlways(Row):
    def forward(self, x):
        y = x @ self.weight.T
        return all_reduce(y + self.bias if self.tp_rank == 0 else y, self.tp_size)


class LoaderForWeightsOnly(Row):
    def weight_loader(self, param, loaded, shard_id=None):
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * cols, cols).materialize())


class SlicesItsSliceAgain(Row):
    def forward(self, x):
        cols = self.input_size // self.tp_size
        return super().forward(x[:, self.tp_rank * cols:(self.tp_rank + 1) * cols])


class CopiesTheWholeWeight(GateUp):
    def weight_loader(self, param, loaded, shard_id):
        rows = self.local_sizes[shard_id]
        copy_into(param.data.narrow(0, shard_id * rows, rows), loaded.narrow(0, 0, loaded.shape[0]))


@pytest.mark.parametrize("name, impl, words", [
    ("row_linear", NarrowsOneRankOn, "cannot take [12:24] of dim 1 from shape (8, 12) in your weight_loader, line"),
    ("row_linear", NarrowsOneRankOn, "Hint: a narrow past the end of the checkpoint tensor: this rank's rows (or "
                                     "columns) start at tp_rank * its share"),
    ("gate_up_linear", UpAtTheFullOffset, "Hint: a narrow past the end of this rank's parameter"),
    ("row_linear", BiasAlways, "Hint: self.bias is None when the layer is built with bias=False"),
    ("row_linear", LoaderForWeightsOnly, "`cols = param.shape[1]`. Hint: the weight_loader loads the bias too, a 1-D"),
    ("row_linear", SlicesItsSliceAgain, "Hint: x is already this rank's features, (T, input_size / tp_size)"),
    ("gate_up_linear", CopiesTheWholeWeight, "Hint: what you copy must have the shape of where it goes"),
])
def test_an_error_in_a_layer_part_gets_the_hint_that_names_its_mistake(name, impl, words):
    result = check_part(name, impl)
    assert result.ok is False and words in result.message, result.message


class PaddingSlicedOffTheTokens(LMHead):
    def forward(self, hidden):
        logits = all_gather(hidden @ self.weight.T, self.tp_size, dim=-1)
        return logits[: self.num_embeddings]                       # dim 0, the tokens: the padding stays


class IdsNotShifted(Embedding):
    def forward(self, input_ids):
        local = input_ids                                           # not minus this rank's first id
        mine = (local >= 0) & (local < self.per_rank)
        y = self.weight[local.masked_fill(~mine, 0)].masked_fill(~mine[:, None], 0.0)
        return all_reduce(y, self.tp_size)


@pytest.mark.parametrize("name, impl, words", [
    ("lm_head", PaddingSlicedOffTheTokens, "drop the padding on the last dim, the vocabulary, logits[:, "
                                           ":num_embeddings] (the first 11); logits[:num_embeddings] slices dim 0"),
    ("embedding", IdsNotShifted, "every rank looked the ids up as they are, as rows of its own shard: the ids are the "
                                 "whole vocabulary's, and rank r's row 0 is id r * 6. Subtract this rank's first id"),
])
def test_a_vocabulary_part_indexed_on_the_wrong_dim_or_rows_is_named(name, impl, words):
    result = check_part(name, impl)
    assert result.ok is False and words in result.message, result.message
