"""A random checkpoint of exactly Qwen2.5-0.5B's shape: loads, and TP 2 gives HF's greedy tokens."""
import pytest

from conftest import hf_greedy
from tplab import LLM, SamplingParams, models

QWEN25_0_5B = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24,
                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=0.02)


@pytest.mark.slow
def test_qwen25_05b_shape_tp2_matches_hf(tmp_path, hf_model):
    folder = models.save_random_qwen2(tmp_path, seed=0, **QWEN25_0_5B)
    prompts = [[9707, 11, 1879, 0, 358, 1079], [151643, 40, 2776]]
    with LLM(folder, tensor_parallel_size=2, num_kv_blocks=32) as llm:
        assert [info["param_bytes"] for info in llm.rank_info][0] < 0.6 * 494e6 * 4   # each rank: its half
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    model = hf_model(folder)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(model, prompt, 6)
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1], strict=True)) <= ref.bound
