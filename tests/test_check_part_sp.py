"""check_part("sp_norm_region", ...): a learner's sequence-parallel norm region, alone in real ranks and in
the engine under sequence parallelism against HF at TP 2 and 4; each usual mistake named; a stub not attempted."""
import sys

import cloudpickle
import pytest

from tplab import LLM, SamplingParams
from tplab.distributed.parallel_state import all_gather, all_reduce, reduce_scatter
from tplab.exercises import check_part
from tplab.exercises.parts import reference
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

Region = define("sp_norm_region")["MySequenceParallelNormRegion"]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_region_written_from_scratch_passes_at_tp2_and_tp4(tp):
    assert Region.__mro__[1] is object                                 # not a subclass of tplab's
    result = check_part("sp_norm_region", Region, tensor_parallel_size=tp)
    assert result.ok is True, result.message
    assert f"greedy tokens at TP {tp} equal HF's" in result.message


def test_the_region_gives_hf_greedy_tokens_through_llm_with_sequence_parallel():
    ref = reference()
    with LLM(ref["model"], tensor_parallel_size=2, sequence_parallel=True, parts={"sp_norm_region": Region}) as llm:
        outs = llm.generate(ref["prompts"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref["tokens"]


class Stub(Region):
    def add(self, partial, residual=None):
        raise NotImplementedError


class NoPadding(Region):
    def add(self, partial, residual=None):
        summed = reduce_scatter(partial, self.tp_size, dim=0)
        return summed if residual is None else residual + summed


class AllReduced(Region):
    def add(self, partial, residual=None):
        return all_reduce(partial.clone(), self.tp_size)              # every token's sum, on every rank


class HiddenDim(Region):
    def add(self, partial, residual=None):
        summed = reduce_scatter(self.pad(partial), self.tp_size, dim=1).reshape(-1, partial.shape[1])
        return summed if residual is None else residual + summed


class NoResidual(Region):
    def add(self, partial, residual=None):
        return super().add(partial)


class NormTwice(Region):
    def norm_gather(self, x, norm):
        return norm(super().norm_gather(x, norm))


class GatherOnDefaultDim(Region):
    def norm_gather(self, x, norm):
        return all_gather(norm(x), self.tp_size)


class KeepsPadding(Region):
    def norm_gather(self, x, norm):
        return all_gather(norm(x), self.tp_size, dim=0)


class NormAfterGather(Region):
    def norm_gather(self, x, norm):
        return norm(all_gather(x, self.tp_size, dim=0)[:self.num_tokens])


def test_a_stub_is_not_attempted():
    assert check_part("sp_norm_region", Stub).ok is None


@pytest.mark.parametrize("impl,words", [
    (NoPadding, "pad them with zero rows"),
    (AllReduced, "that is an all-reduce"),
    (HiddenDim, "hidden dimension (dim 1)"),
    (NoResidual, "did not add the residual"),
    (NormTwice, "applied the norm twice"),
    (GatherOnDefaultDim, "dim defaults to -1"),
    (KeepsPadding, "kept the padding rows"),
    (NormAfterGather, "normed the gathered tokens"),
])
def test_region_mistakes_are_named(impl, words):
    result = check_part("sp_norm_region", impl)
    assert result.ok is False and words in result.message, result.message
