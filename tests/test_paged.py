"""The paged engine against HF: continuous batching, preemption and prefix caching keep greedy output exact."""
import pytest

from conftest import hf_greedy
from tplab import LLM, SamplingParams

MAX_TOKENS = 10
SHARED = list(range(60, 100))                               # a 40-token prefix (2.5 blocks of 16)
PROMPTS = [[3, 17, 42, 99, 5], list(range(1, 30)), [250, 7], SHARED + [1, 2, 3], [11, 12] * 10,
           SHARED + [4], list(range(100, 160)), SHARED + [5, 6]]


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    model = hf_model(checkpoint("gqa"))
    return [hf_greedy(model, p, MAX_TOKENS)[0] for p in PROMPTS]


def run(folder, tp, steps=None, **kwargs):
    """Tokens and stats of PROMPTS; at TP 1, ``steps`` gets each step's ``[(seq_id, tokens fed)]``."""
    with LLM(folder, tensor_parallel_size=tp, **kwargs) as llm:
        if steps is not None and tp == 1:
            scheduler = llm._worker.engine.scheduler
            schedule = scheduler.schedule

            def recording():
                batch = schedule()
                steps.append([(s.seq_id, s.num_scheduled_tokens) for s in batch])
                return batch
            scheduler.schedule = recording
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        return [o.token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("tp", [1, 2])
def test_continuous_batching_matches_hf_and_frees_every_block(checkpoint, reference, tp):
    steps = []
    tokens, stats = run(checkpoint("gqa"), tp, steps, max_num_seqs=3, block_size=8)  # 8 requests, 3 at a time
    assert tokens == reference
    assert stats["kv_blocks_in_use"] == 0 and stats["num_preemptions"] == 0
    # rounds of 3, 3 and 2 requests, each a prefill step then MAX_TOKENS - 1 decodes: a round starts in the
    # step after the one its predecessors finished in, with no step lost between them
    assert stats["num_steps"] == 3 * MAX_TOKENS, stats
    if tp == 1:
        assert [len(step) for step in steps] == [3] * 2 * MAX_TOKENS + [2] * MAX_TOKENS   # 3 at a time, at most


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_cache_preempts_and_still_matches_hf(checkpoint, reference, tp):
    tokens, stats = run(checkpoint("gqa"), tp, num_kv_blocks=12, block_size=8)
    assert stats["num_preemptions"] > 0, stats
    # preempted only when the cache was full: every one of the 12 blocks was in use at the peak
    assert stats["peak_kv_blocks_used"] == 12 and stats["kv_blocks_in_use"] == 0
    assert tokens == reference


@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_caching_hits_and_matches_hf(checkpoint, reference, tp):
    tokens, stats = run(checkpoint("gqa"), tp, enable_prefix_caching=True, max_num_seqs=2)
    assert stats["prefix_cache_hit_blocks"] > 0, stats
    assert tokens == reference and stats["kv_blocks_in_use"] == 0


def test_a_prefix_hit_is_the_same_block_at_the_same_position(checkpoint, hf_model):
    """The first prompt's three full blocks hold the same 4 tokens at positions 0, 4 and 8 (different K/V:
    RoPE); the second starts with those tokens at position 0 and must reuse block 0 only: HF's output."""
    first, second = [5, 6, 7, 8] * 3 + [9], [5, 6, 7, 8, 1, 2]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(checkpoint("gqa"), enable_prefix_caching=True, block_size=4) as llm:
        llm.generate([first], params)
        out = llm.generate([second], params)[0]
        assert llm.stats()["prefix_cache_hit_blocks"] == 1
    ref = hf_greedy(hf_model(checkpoint("gqa")), second, 6)
    assert out.token_ids == ref[0]
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


def test_kv_blocks_from_memory_budget(checkpoint):
    folder = checkpoint("gqa")                              # 2 layers, 2 KV heads of 16 dims, fp32
    per_block = 2 * 2 * 16 * 2 * 16 * 4                     # K and V x layers x block x heads x dim x bytes
    with LLM(folder, kv_cache_memory=10 * per_block) as llm:
        assert llm.stats()["num_kv_blocks"] == 10 and llm.stats()["kv_cache_bytes"] == 10 * per_block


def test_prompt_that_can_never_fit_is_an_error_not_a_hang(checkpoint, hf_model):
    with LLM(checkpoint("gqa"), num_kv_blocks=4, block_size=8) as llm:
        with pytest.raises(ValueError, match=r"prompt 1 needs 5 KV blocks of 8 tokens .* the cache has 4"):
            llm.generate([[1, 2], list(range(30))], SamplingParams(max_tokens=10))
        out = llm.generate([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True))[0]   # still serves, rightly
    assert out.token_ids == hf_greedy(hf_model(checkpoint("gqa")), [1, 2], 4)[0]
