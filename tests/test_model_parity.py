"""Whole-model parity: tplab's greedy tokens equal HF's exactly, logprobs within the fp32 bound
(``tplab.tolerance``), at TP 1, 2, 4."""
import pytest

from conftest import CONFIGS, hf_greedy
from tplab import LLM, SamplingParams

PROMPTS = [[3, 17, 42, 99, 5], [250, 7], list(range(40, 71)), [11] * 9]   # lengths 5, 2, 31, 9
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_reference(checkpoint, hf_model):
    cache = {}

    def ref(name):
        if name not in cache:
            model = hf_model(checkpoint(name))
            cache[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        return cache[name]
    return ref


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_and_logprobs_match_hf(name, tp, checkpoint, hf_reference):
    with LLM(checkpoint(name), tensor_parallel_size=tp) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out, ref in zip(PROMPTS, outs, hf_reference(name), strict=True):
        ref_tokens, ref_logprobs = ref
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref_tokens, f"{name} tp{tp}: tokens differ from HF for prompt {prompt[:5]}..."
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs, strict=True))
        assert worst <= ref.bound, f"{name} tp{tp}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"
    distinct = {t for tokens, _ in hf_reference(name) for t in tokens}
    assert len(distinct) >= 8, f"HF's own output uses only {len(distinct)} token ids: too weak a reference"


def test_batched_equals_one_at_a_time(checkpoint):
    """Batching prompts of different lengths in one step changes nothing for any of them."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(checkpoint("gqa")) as llm:
        together = [o.token_ids for o in llm.generate(PROMPTS, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert together == alone
