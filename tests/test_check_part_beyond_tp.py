"""check_part for notebook 07's parts. The sequence-parallel norm region: alone in real ranks (its numbers, then its
collectives against SP's own), then the engine under sequence parallelism against HF at TP 2 and 4. The pipeline
stage: its split, the boundary in watched real ranks, then the engine at t x 2 stages against HF. The reference
parts pass; each usual mistake is named for what it is, a hang or an abort within seconds; a stub is not attempted."""
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as torch_all_reduce

from tplab import LLM, SamplingParams
from tplab.distributed.launcher import RankError
from tplab.distributed.parallel_state import all_gather, all_reduce, isend, recv, reduce_scatter
from tplab.exercises import check_engine, check_part, in_engine
from tplab.exercises.parts import _exception_result, reference
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

Region = define("sp_norm_region")["MySequenceParallelNormRegion"]
Stage = define("pipeline_stage")["MyPipelineStage"]
NAMED_WITHIN_S = 120          # a mistake, a hang or an abort included, is named within 2 minutes


@pytest.mark.parametrize("name,impl,tp", [("sp_norm_region", Region, 2), ("sp_norm_region", Region, 4),
                                          ("pipeline_stage", Stage, 1), ("pipeline_stage", Stage, 2)],
                         ids=["region-tp2", "region-tp4", "stage-tp1", "stage-tp2"])
def test_a_part_written_from_scratch_passes(name, impl, tp):
    assert impl.__mro__[1] is object                                   # not a subclass of tplab's
    result = check_part(name, impl, tensor_parallel_size=tp)
    assert result.ok is True, result.message
    assert ("greedy tokens equal HF's" in result.message and f"TP {tp} x PP 2" in result.message
            if name == "pipeline_stage" else f"greedy tokens at TP {tp} equal HF's" in result.message)


def test_the_region_gives_hf_greedy_tokens_through_llm_with_sequence_parallel():
    ref = reference()
    with LLM(ref["model"], tensor_parallel_size=2, sequence_parallel=True, parts={"sp_norm_region": Region}) as llm:
        outs = llm.generate(ref["prompts"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref["tokens"]


class RegionStub(Region):
    def add(self, partial, residual=None):
        raise NotImplementedError


class StageStub(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        raise NotImplementedError


@pytest.mark.parametrize("name,impl", [("sp_norm_region", RegionStub), ("pipeline_stage", StageStub)])
def test_a_stub_is_not_attempted(name, impl):
    assert check_part(name, impl).ok is None


# The region's mistakes ---------------------------------------------------------------------------------------------
def _mistake(name, base, **methods):
    """A mistake in one or two methods, as the class a learner's cell defines (the other methods right)."""
    return type(name, (base,), methods)


class FloorPerRank(Region):
    def __init__(self, num_tokens, tp_rank, tp_size):                 # T // t rows each: add then raises
        super().__init__(num_tokens, tp_rank, tp_size)
        self.per_rank = num_tokens // tp_size
        self.padded = self.per_rank * tp_size


class NoPadding(Region):
    def add(self, partial, residual=None):
        summed = reduce_scatter(partial, self.tp_size, dim=0)
        return summed if residual is None else residual + summed


class AllReduced(Region):
    def add(self, partial, residual=None):
        return all_reduce(partial.clone(), self.tp_size)              # every token's sum, on every rank


class AllReduceAndSlice(Region):
    def add(self, partial, residual=None):                             # the right numbers, plain TP's collective
        summed = self.local(all_reduce(partial.clone(), self.tp_size))
        return summed if residual is None else residual + summed


class AllReduceInPlace(Region):
    def add(self, partial, residual=None):                             # the same, on partial itself, through torch
        dist.all_reduce(partial)
        summed = self.local(partial)
        return summed if residual is None else residual + summed


class AllReduceByName(Region):
    def add(self, partial, residual=None):                             # torch's, imported by name (by reference)
        summed = partial.clone()
        torch_all_reduce(summed)
        summed = self.local(summed)
        return summed if residual is None else residual + summed


class HiddenDim(Region):
    def add(self, partial, residual=None):
        summed = reduce_scatter(self.pad(partial), self.tp_size, dim=1).reshape(-1, partial.shape[1])
        return summed if residual is None else residual + summed


# The stage's mistakes ----------------------------------------------------------------------------------------------
class FloorDivision(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        super().__init__(num_layers, pp_rank, pp_size, tp_rank, tp_size)
        per = num_layers // pp_size
        self.layers = self.kv_cache_layers = range(pp_rank * per, (pp_rank + 1) * per)


class EndsEarly(Stage):
    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        super().__init__(num_layers, pp_rank, pp_size, tp_rank, tp_size)
        self.layers = self.kv_cache_layers = range(self.layers.start, self.layers.stop - 1)


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
        for request in self._sending:
            request.wait()
        self._sending = [isend(hidden, self.peer(self.pp_rank + 1))]

    def recv(self, rows, hidden_size, dtype, device):
        hidden = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), self.peer(self.pp_rank - 1))
        return hidden, torch.zeros_like(hidden)


class BlockingSend(Stage):
    def send(self, hidden, residual):
        dist.send(hidden.contiguous(), self.peer(self.pp_rank + 1))
        dist.send(residual.contiguous(), self.peer(self.pp_rank + 1))


class DropsRequests(Stage):
    def send(self, hidden, residual):                                  # the requests are not kept
        isend(hidden, self.peer(self.pp_rank + 1))
        isend(residual, self.peer(self.pp_rank + 1))


class Bf16Buffers(Stage):
    def recv(self, rows, hidden_size, dtype, device):                  # bf16 whatever the dtype asked
        return tuple(recv(torch.empty(rows, hidden_size, dtype=torch.bfloat16, device=device),
                          self.peer(self.pp_rank - 1)) for _ in range(2))


class IgnoresTheDtype(Stage):
    def recv(self, rows, hidden_size, dtype, device):                  # fp32 whatever the dtype asked: bf16 dies
        return tuple(recv(torch.empty(rows, hidden_size, device=device), self.peer(self.pp_rank - 1))
                     for _ in range(2))


MISTAKES = [  # (part, impl, TP size, words the message must hold, words it must not)
    ("sp_norm_region", NoPadding, 2, "pad them with zero rows", None),
    ("sp_norm_region", AllReduced, 2, "that is an all-reduce", None),
    ("sp_norm_region", AllReduceAndSlice, 2, "gives the right numbers, but it ran all_reduce of 256 B (put in) where "
     "sequence parallelism runs one reduce_scatter of 256 B. Counted as notebook 07 counts a ring, it sends 256 B "
     "from each rank, where SP sends 128 B", "self.pad("),         # the notebook's stub has no pad method
    ("sp_norm_region", AllReduceInPlace, 2, "but it ran all_reduce of 256 B (put in)", "embed_tokens"),
    ("sp_norm_region", AllReduceByName, 2, "but it ran all_reduce of 256 B (put in)", None),
    ("sp_norm_region", HiddenDim, 2, "hidden dimension (dim 1)", None),
    ("sp_norm_region", _mistake("NoResidual", Region, add=lambda self, partial, residual=None: Region.add(
        self, partial)), 2, "did not add the residual", None),
    ("sp_norm_region", _mistake("NormTwice", Region, norm_gather=lambda self, x, norm: norm(Region.norm_gather(
        self, x, norm))), 2, "applied the norm twice", None),
    ("sp_norm_region", _mistake("GatherOnDefaultDim", Region, norm_gather=lambda self, x, norm: all_gather(
        norm(x), self.tp_size)), 2, "dim defaults to -1", None),
    ("sp_norm_region", _mistake("KeepsPadding", Region, norm_gather=lambda self, x, norm: all_gather(
        norm(x), self.tp_size, dim=0)), 2, "kept the padding rows", None),
    ("sp_norm_region", _mistake("NormAfterGather", Region, norm_gather=lambda self, x, norm: norm(all_gather(
        x, self.tp_size, dim=0)[:self.num_tokens])), 2, "normed the gathered tokens", None),
    ("sp_norm_region", _mistake("AddReturnsTuple", Region, add=lambda self, partial, residual=None: (Region.add(
        self, partial, residual), residual)), 2, "add(partial) returned a tuple, not a tensor: return only",
     "Attribute"),
    ("pipeline_stage", FloorDivision, 1, "layers [4] belong to no stage ([[0, 1], [2, 3]]): num_layers // pp_size "
     "each drops the remainder", None),
    ("pipeline_stage", EndsEarly, 1, "4 layers in 2 stages: each stage's range ends one layer early ([[0], [2]]; "
     "layers [1, 3] belong to no stage)", "remainder"),
    ("pipeline_stage", HeadEverywhere, 1, "belong to the last stage only", None),
    ("pipeline_stage", KVEveryLayer, 1, "memory for nothing", None),
    ("pipeline_stage", HiddenOnly, 1, "not the residual stream", None),
    ("pipeline_stage", _mistake("Swapped", Stage, recv=lambda self, *args: Stage.recv(self, *args)[::-1]), 1,
     "swapped", None),
    ("pipeline_stage", _mistake("PeerWithoutTP", Stage, peer=lambda self, pp_rank: pp_rank), 2, "rank 0 (stage 0, "
     "TP rank 0): isend to world rank 1; its peer is world rank 2, the same TP rank one stage away: a stage's peer "
     "is world rank (pp_rank +/- 1) * tp_size + tp_rank", None),
    ("pipeline_stage", BlockingSend, 2, "its send used dist.send, which returns only once the peer has received "
     "(a blocking send)", "peer is world rank"),
    ("pipeline_stage", DropsRequests, 2, "its send dropped 2 of the 2 requests isend returned, without wait(). gloo "
     "loses a message whose request is garbage-collected", "peer is world rank"),
    ("pipeline_stage", Bf16Buffers, 2, "rank 2 (stage 1, TP rank 0): its recv made a (5, 8) torch.bfloat16 buffer "
     "of 80 B for the (5, 8) torch.float32 tensor of 160 B the previous stage sent", "died"),
    ("pipeline_stage", IgnoresTheDtype, 2, "rank 2 (stage 1, TP rank 0): its recv made a (1, 8) torch.float32 buffer "
     "of 32 B for the (1, 8) torch.bfloat16 tensor of 16 B the previous stage sent", "died"),
    ("sp_norm_region", _mistake("NoAllGather", Region, norm_gather=lambda self, x, norm: norm(x)), 2,
     "norm_gather returned this rank's 3 normed rows, not gathered: the next layer needs all T tokens", None),
    ("sp_norm_region", _mistake("LocalNoPad", Region, local=lambda self, full: full[
        self.tp_rank * self.per_rank:(self.tp_rank + 1) * self.per_rank]), 4, "local(full) gave 1 row(s), past the "
     "end of the T tokens: pad them with zero rows", None),
    ("sp_norm_region", FloorPerRank, 2, "per_rank = T // tp_size leaves out T % tp_size tokens", "size of tensor"),
    ("sp_norm_region", _mistake("Rank0Only", Region, add=lambda self, partial, residual=None: Region.add(
        self, partial, residual) if self.tp_rank == 0 else self.local(partial)), 2, "rank(s) [0] had not ended "
     "add(partial) after 15 s, while rank 1 ran no collective in it", "did not finish in time"),
    ("pipeline_stage", _mistake("SendsResidualTwice", Stage, send=lambda self, hidden, residual: Stage.send(
        self, residual, residual)), 1, "received (residual, residual) for (hidden, residual): the same tensor twice",
     None),
    ("pipeline_stage", _mistake("SendsTheSum", Stage, send=lambda self, hidden, residual: Stage.send(
        self, hidden + residual, residual)), 2, "(hidden + residual, residual) for (hidden, residual): send hidden "
     "and residual as they are", None),
    ("pipeline_stage", _mistake("RecvsNothing", Stage, recv=lambda self, rows, size, dtype, device: (torch.zeros(
        rows, size, dtype=dtype),) * 2), 1, "received (zeros, zeros) for (hidden, residual): a buffer nothing was "
     "received into?", None),
    ("pipeline_stage", _mistake("RecvNoReturn", Stage, recv=lambda self, *args: Stage.recv(self, *args) and None), 1,
     "recv must return the pair (hidden, residual), got NoneType: did you forget `return`?", None),
]


@pytest.mark.parametrize("name,impl,tp,words,not_words", MISTAKES, ids=[m[1].__name__ for m in MISTAKES])
def test_each_mistake_is_named_within_two_minutes(name, impl, tp, words, not_words):
    start = time.monotonic()
    result = check_part(name, impl, tensor_parallel_size=tp)
    assert result.ok is False and words in result.message, result.message
    assert not_words is None or not_words not in result.message, result.message
    assert time.monotonic() - start < NAMED_WITHIN_S


class Bf16OnlyForLongPrompts(Stage):
    def recv(self, rows, hidden_size, dtype, device):   # right at the boundary's 5 rows, bf16 in the engine's prefill
        dtype = torch.bfloat16 if rows > 5 else dtype
        return tuple(recv(torch.empty(rows, hidden_size, dtype=dtype, device=device),
                          self.peer(self.pp_rank - 1)) for _ in range(2))


def test_a_rank_that_gloo_aborts_is_reported_with_gloos_reason():
    """What the boundary cannot see and gloo aborts a rank for, inside the engine: the message carries gloo's words
    (on the rank's stderr, not in any Python traceback), not only the signal."""
    start = time.monotonic()
    result = check_part("pipeline_stage", Bf16OnlyForLongPrompts, tensor_parallel_size=1)
    assert result.ok is False and "inside the engine at TP 1 x PP 2, rank 1 was aborted by gloo:" in result.message
    assert "Received data size doesn't match expected size" in result.message, result.message
    assert "Hint: a recv (or a collective) was given a buffer of another size" in result.message
    assert time.monotonic() - start < NAMED_WITHIN_S


def _abort(_):
    if dist.get_rank() == 0:
        dist.isend(torch.ones(3, 8), 1).wait()
    else:
        dist.recv(torch.zeros(3, 8, dtype=torch.bfloat16), 0)


def test_gloos_reason_is_read_from_the_dead_ranks_stderr():
    group = in_engine.kept_ranks(2, 60, "abort")
    with pytest.raises(RankError) as raised:
        group.run(_abort, (None,))
    assert "died (signal 6, SIGABRT)" in str(raised.value)
    assert "Received data size doesn't match" in in_engine.aborted_because(raised.value, group)
    assert in_engine.aborted_because(raised.value, None) is None      # a group the checker did not start: no file
    result = _exception_result("pipeline_stage", Stage, raised.value, "at the boundary", group)
    assert result.ok is False and result.message.startswith("at the boundary, rank 1 was aborted by gloo: ")


def test_check_engine_leaves_notebook_07s_parts_to_notebook_07():
    """notebook 06's finale, after a Run All of notebook 07: its two parts are left out of the TP engine (the
    region needs sequence parallelism, the stage needs stages) and named as judged there."""
    result = check_engine({"pipeline_stage": StageStub, "sp_norm_region": RegionStub})
    assert result.ok is None and "not attempted yet" in result.message, result
    assert "notebook 07's pipeline_stage, sp_norm_region: judged there" in result.message, result
    row = define("row_linear")["MyRowParallelLinear"]          # not ReturnsPartialSums: no SP engine could take it
    result = check_engine({"row_linear": row, "sp_norm_region": Region, "pipeline_stage": Stage})
    assert result.ok is True and "judged there" in result.message, result.message
    assert "tplab's own embedding, qkv_linear, attention, gate_up_linear, lm_head, block_manager:" in result.message


def test_a_pipeline_check_leaves_the_tp_checks_ranks_alone():
    """A pipeline engine sets a t x p layout in its ranks' processes; the TP checks that follow (notebook 07 run
    twice in one kernel) must not inherit it: they run in other ranks."""
    assert check_part("pipeline_stage", Stage, tensor_parallel_size=1).ok is True
    result = check_part("sp_norm_region", Region, tensor_parallel_size=2)
    assert result.ok is True, result.message
