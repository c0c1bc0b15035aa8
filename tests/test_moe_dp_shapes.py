"""Checkpoints no other test sees, of other shapes (6 experts, top-1, no shared expert and Qwen3's attention; 12
experts, top-3, a shared expert, dense layers between the sparse ones, 6 heads on 2 KV heads), made here from a
seed: greedy tokens equal HF's and logprobs are within the fp32 bound at EP 2, at DP 2 x EP, at TP 2 x PP 2 with
EP and at DP 2 x PP 2 x EP."""
import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, models

MAX_TOKENS = 6
SHAPES = {
    "qwen3_moe-e6-top1": lambda d: models.save_random_qwen3_moe(
        d, seed=11, num_experts=6, num_experts_per_tok=1, norm_topk_prob=False, hidden_size=96, head_dim=16,
        num_attention_heads=6, num_key_value_heads=2, moe_intermediate_size=24, num_hidden_layers=4),
    "qwen2_moe-e12-top3-shared": lambda d: models.save_random_qwen2_moe(
        d, seed=12, num_experts=12, num_experts_per_tok=3, norm_topk_prob=True, shared_expert_intermediate_size=40,
        decoder_sparse_step=2, intermediate_size=80, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
        moe_intermediate_size=16, num_hidden_layers=4),
}
LAYOUTS = {"ep2": dict(tensor_parallel_size=2), "dp2-ep": dict(data_parallel_size=2),
           "tp2-pp2-ep": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
           "dp2-pp2-ep": dict(data_parallel_size=2, pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def shape(tmp_path_factory, hf_model):
    """``shape(name)`` -> (its folder, random prompts from a seed, HF's greedy references)."""
    made = {}

    def make(name):
        if name not in made:
            folder = SHAPES[name](tmp_path_factory.mktemp(name))
            gen = torch.Generator().manual_seed(len(name))
            prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (23, 5, 40, 2, 17)]
            made[name] = folder, prompts, [hf_greedy(hf_model(folder), p, MAX_TOKENS) for p in prompts]
        return made[name]
    return make


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_an_unseen_shape_equals_hf_token_for_token(name, layout, shape):
    folder, prompts, refs = shape(name)
    with LLM(folder, enable_expert_parallel=True, max_num_batched_tokens=16, **LAYOUTS[layout]) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for out, prompt, ref in zip(outs, prompts, refs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref[0], f"{name} {layout}: tokens differ from HF for a prompt of {len(prompt)} tokens"
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref[1], strict=True))
        assert worst <= ref.bound, f"{name} {layout}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"
    assert len({t for tokens, _ in refs for t in tokens}) >= 8, "HF's own output is too weak a reference"
