"""check_part: learners' layers written from scratch pass it; each usual mistake is rejected with its
diagnosis. A stub, a part that raises or hangs in a rank: test_check_part_errors.py."""
import re
import sys

import cloudpickle
import pytest
import torch

from tplab import LLM, SamplingParams, golden
from tplab.distributed.parallel_state import all_gather, all_reduce
from tplab.exercises import check_part
from tplab.exercises.parts import reference
from tplab.exercises.solutions import PARTS, define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

SOLUTION = {name: define(name)[cls] for name, cls in PARTS.items() if name in
            ("row_linear", "gate_up_linear", "qkv_linear", "embedding", "lm_head")}
Row, GateUp, QKV = SOLUTION["row_linear"], SOLUTION["gate_up_linear"], SOLUTION["qkv_linear"]
Embedding, Head = SOLUTION["embedding"], SOLUTION["lm_head"]


@pytest.mark.parametrize("name", sorted(SOLUTION))
def test_a_part_written_from_scratch_passes(name):
    assert not any(c.__module__.startswith("tplab.layers") for c in SOLUTION[name].__mro__)   # not tplab's
    result = check_part(name, SOLUTION[name])
    assert result.ok is True, result.message
    assert "every sublayer is within" in result.message and "greedy tokens at TP 2 equal HF's" in result.message


@pytest.mark.parametrize("name", sorted(SOLUTION))
def test_the_part_gives_hf_greedy_tokens_through_llm_at_tp2(name):
    ref = reference()
    with LLM(ref["model"], tensor_parallel_size=2, parts={name: SOLUTION[name]}) as llm:
        outs = llm.generate(ref["prompts"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref["tokens"]


def test_qkv_with_kv_replication_passes_at_tp4():
    result = check_part("qkv_linear", QKV, tensor_parallel_size=4)      # 2 KV heads, 4 ranks: replicas
    assert result.ok is True, result.message


class NoAllReduce(Row):
    def forward(self, x):
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None and self.tp_rank == 0 else y


class ReducedTwice(Row):
    def forward(self, x):
        return all_reduce(super().forward(x), self.tp_size)


class Averaged(Row):
    def forward(self, x):
        return super().forward(x) / self.tp_size


class BiasOnEveryRank(Row):
    def forward(self, x):
        y = x @ self.weight.T
        return all_reduce(y + self.bias if self.bias is not None else y, self.tp_size)


class WrongDimRow(Row):
    """Allocates and loads the column-parallel shard (rows) instead of columns."""
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        self.weight = torch.nn.Parameter(torch.empty(output_size // self.tp_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:
            return super().weight_loader(param, loaded, shard_id)
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * rows, rows).materialize())


@pytest.mark.parametrize("impl, words", [
    (NoAllReduce, "no all-reduce"), (ReducedTwice, "reduced twice"), (Averaged, "averaged"),
    (BiasOnEveryRank, "bias is counted 2 times"), (WrongDimRow, "sharded on the wrong dimension")])
def test_row_linear_mistakes_are_named(impl, words):
    result = check_part("row_linear", impl)
    assert result.ok is False and words in result.message, result.message


class Swapped(GateUp):
    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, loaded, 1 - shard_id)


def test_gate_up_with_gate_and_up_swapped_is_named():
    result = check_part("gate_up_linear", Swapped)
    assert result.ok is False and "shard_id 0 is gate_proj" in result.message, result.message


class NotReplicated(QKV):
    """Takes KV head tp_rank, as if there were at least as many KV heads as ranks."""
    def weight_loader(self, param, loaded, shard_id):
        self.replicas = 1
        super().weight_loader(param, loaded, shard_id)


class ModuloKV(QKV):
    """Keeps KV head tp_rank % total_num_kv_heads: every KV head is kept, by the wrong ranks."""
    def weight_loader(self, param, loaded, shard_id):
        if shard_id == "q":
            return super().weight_loader(param, loaded, shard_id)
        heads = loaded.shape[0] // self.kv_size                     # total KV heads
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        start = (self.tp_rank % heads) * self.kv_size
        param.data.narrow(0, offset, self.kv_size).copy_(loaded.narrow(0, start, self.kv_size).materialize())


def test_qkv_without_kv_replication_fails_with_the_rank_and_line():
    result = check_part("qkv_linear", NotReplicated, tensor_parallel_size=4)
    assert result.ok is False and re.search("rank [23] raised", result.message) and "cannot take" in result.message, \
        result.message                                              # ranks 2 and 3 both ask for a third KV head
    assert "line" in result.message
    assert "k's and v's rows start at (tp_rank // replicas) * kv_size" in result.message, result.message
    assert "(the full size // tp_size)" not in result.message, result.message     # the general hint misleads here


def test_qkv_keeping_the_wrong_kv_head_is_named():
    result = check_part("qkv_linear", ModuloKV, tensor_parallel_size=4)
    assert result.ok is False and "attend with KV head 0" in result.message, result.message


class Unmasked(Embedding):
    def forward(self, input_ids):
        local = (input_ids - self.start).clamp(0, self.per_rank - 1)
        return all_reduce(self.weight[local], self.tp_size)


class EmbeddingNoAllReduce(Embedding):
    def forward(self, input_ids):
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        return self.weight[local.masked_fill(~mine, 0)].masked_fill(~mine[:, None], 0.0)


@pytest.mark.parametrize("impl, words", [(Unmasked, "ids outside this rank's rows"),
                                         (EmbeddingNoAllReduce, "no all-reduce")])
def test_embedding_mistakes_are_named(impl, words):
    result = check_part("embedding", impl)
    assert result.ok is False and words in result.message, result.message


class NoGather(Head):
    def forward(self, hidden):
        return hidden @ self.weight.T


class PaddingKept(Head):
    def forward(self, hidden):
        return all_gather(hidden @ self.weight.T, self.tp_size, dim=-1)


@pytest.mark.parametrize("impl, words", [(NoGather, "all-gather every rank's"), (PaddingKept, "drop the padding")])
def test_lm_head_mistakes_are_named(impl, words):
    result = check_part("lm_head", impl)                 # the probe's vocabulary of 11 is padded to 12 at TP 2
    assert result.ok is False and words in result.message, result.message


class GateUpDim1Reshaped(GateUp):
    """The student's shard_dim1 bug in the fused loader: input columns narrowed, reshaped into the shard's rows."""
    def weight_loader(self, param, loaded, shard_id):
        rows, cols = self.local_sizes[shard_id], loaded.shape[1] // self.tp_size
        part = loaded.narrow(1, self.tp_rank * cols, cols).materialize().reshape(rows, -1)
        param.data.narrow(0, sum(self.local_sizes[:shard_id]), rows).copy_(part)


class KVSwapped(QKV):
    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, loaded, {"k": "v", "v": "k"}.get(shard_id, shard_id))


class MaskedNotZeroed(Embedding):
    """Sends the ids it does not own to local row 0, and forgets to zero those rows."""
    def forward(self, input_ids):
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        return all_reduce(self.weight[local.masked_fill(~mine, 0)], self.tp_size)


class RowFloat64Out(Row):
    def forward(self, x):
        return super().forward(x).double()


class HeadFloat64(Head):
    def forward(self, hidden):
        return super().forward(hidden).double()


class RowFloat64Weight(Row):
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        self.weight.data = self.weight.data.double()

    def forward(self, x):
        return super().forward(x.double()).float()


@pytest.mark.parametrize("name, impl, words", [
    ("gate_up_linear", GateUpDim1Reshaped, "input columns (dim 1), reshaped into rows"),
    ("qkv_linear", KVSwapped, "holds [q | v | k]: the k and v rows are swapped"),
    ("embedding", MaskedNotZeroed, "masked to a valid row (local row 0) but that row was not zeroed"),
    ("row_linear", RowFloat64Out, "forward's output is torch.float64, but the engine runs this layer in "
                                  "torch.float32"),
    ("row_linear", RowFloat64Weight, "`weight` is torch.float64, but the engine runs this layer in torch.float32"),
    ("lm_head", HeadFloat64, "forward's output is torch.float64, but the engine runs this layer in torch.float32")])
def test_more_mistakes_are_named(name, impl, words):
    result = check_part(name, impl)
    assert result.ok is False and words in result.message, result.message


class Float64InTheEngineOnly(Row):
    """Right on the probe's 3 tokens, float64 on longer inputs: the next layer of the real model meets it."""
    def forward(self, x):
        y = super().forward(x)
        return y.double() if x.shape[0] > 3 else y


def test_a_float64_that_reaches_the_next_layer_gets_a_dtype_hint():
    result = check_part("row_linear", Float64InTheEngineOnly)
    assert result.ok is False and "another dtype than the model's" in result.message, result.message


class TrainableRow(Row):
    """Parameters with requires_grad=True: the engine steps under torch.inference_mode, so this is harmless."""
    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)
        for p in self.parameters():
            p.requires_grad_(True)

    def weight_loader(self, param, loaded, shard_id=None):
        with torch.no_grad():
            super().weight_loader(param, loaded, shard_id)


def test_parameters_that_require_grad_are_accepted():
    assert all(p.requires_grad for p in TrainableRow(12, 8, bias=True, tp_rank=0, tp_size=1).parameters())
    result = check_part("row_linear", TrainableRow)
    assert result.ok is True, result.message


def test_the_engine_verdicts_judge_each_sublayer_by_its_bound_and_name_nan_and_shapes():
    """check_part's and the pipeline stage's comparisons with HF: tplab.tolerance's bound, relative to each
    activation's size; a NaN or another shape is named as such, not as a difference of inf."""
    from tplab.exercises import parts, pipeline_probe
    ref = reference()

    def verdicts(name, change):
        acts = {n: a.clone() for n, a in ref["acts"].items()}
        acts[name] = change(acts[name])
        stage = {n: a for n, a in acts.items() if n != "logits"}          # a pipeline has no logits
        return (parts._verdict("row_linear", {"row_linear": Row}, 2, [acts], [ref["acts"], acts], ref["tokens"],
                               ref["tokens"], {}).message,
                pipeline_probe._verdict(1, [stage, None], ref["tokens"]).message)

    bound, shape = golden.bound(ref["acts"]["model.layers.0.mlp"]), tuple(ref["acts"]["model.layers.0.mlp"].shape)
    for message in verdicts("model.layers.0.mlp", lambda a: a + 0.5 * bound):
        assert "every sublayer is within its bound of HF (tplab.tolerance" in message, message
        assert "at most 5e-01 of the bound" in message, message
    for change, words in [(lambda a: a + 3 * bound, "from HF's, 3 times its bound"),
                          (lambda a: a.index_fill(0, torch.tensor([1]), float("nan")), "it holds NaN or inf"),
                          (lambda a: a[:, :-1], f"it has shape {(shape[0], shape[1] - 1)}, HF's {shape}")]:
        for message in verdicts("model.layers.0.mlp", change):
            assert "model.layers.0.mlp is the first sublayer that differs from HF" in message and words in message, \
                message
            assert "by inf" not in message

