"""Qwen3 (dense) in the engine against HF's ``Qwen3ForCausalLM``: greedy tokens equal HF's and logprobs are within
the fp32 bound at TP 1 and 2 (chunked prefill, prefix-cache hits and preemption in the same run), with and
without ``attention_bias``; every sublayer, the per-head q/k norms included, against HF's; ``head_dim`` from the
config; and which ``model_type``s the engine takes."""
import json

import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, golden, models
from tplab.models.registry import load_model_config
from tplab.engine.probe import capture, load_model, probe
from tplab.models.registry import MODELS

MAX_TOKENS = 8
SHARED = list(range(60, 100))                                       # a 40-token prefix
PROMPTS = [list(range(1, 70)), [3, 17, 42], SHARED + [1, 2, 3], [250, 7] * 20, SHARED + [4], [9]]
TIGHT = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True)
CHECKPOINTS = {
    "qwen3": dict(),                                                    # head_dim 32 (hidden 64 / 4 heads is 16)
    "bias_untied": dict(attention_bias=True, tie_word_embeddings=False, num_key_value_heads=1, seed=4),
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            settings = dict(CHECKPOINTS[name])
            made[name] = models.save_random_qwen3(tmp_path_factory.mktemp(name), seed=settings.pop("seed", 3),
                                                  **settings)
        return made[name]
    return make


@pytest.fixture(scope="module")
def hf(hf_model, qwen3):
    """``hf(name)`` -> HF's own model on checkpoint ``name`` (conftest's ``hf_model``)."""
    return lambda name: hf_model(qwen3(name))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_hf_with_chunks_prefix_hits_and_preemption(name, tp, qwen3, hf):
    reference = [hf_greedy(hf(name), p, MAX_TOKENS) for p in PROMPTS]
    with LLM(qwen3(name), tensor_parallel_size=tp, **TIGHT) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        stats = llm.stats()
    assert len(outs) == len(reference) == len(PROMPTS)
    for out, ref, prompt in zip(outs, reference, PROMPTS):
        assert out.token_ids == ref[0], f"{name} tp{tp}: tokens differ from HF for a prompt of {len(prompt)} tokens"
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref[1]))
        assert worst <= ref.bound, f"{name} tp{tp}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"
    assert len({t for tokens, _ in reference for t in tokens}) >= 8, "HF's own output is too weak a reference"
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0, stats


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_every_sublayer_and_the_per_head_norms_match_hfs_at_tp1(name, qwen3, hf):
    ids = PROMPTS[3]
    model = load_model(qwen3(name))
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 32 and attn.qkv_proj.weight.shape == ((4 + 2 * attn.num_kv_heads) * 32, 64)
    assert (attn.qkv_proj.bias is not None) == (attn.o_proj.bias is not None) == (name == "bias_untied")
    names = golden.activation_names(len(model.model.layers))[:-1] + \
        [f"model.layers.{i}.self_attn.{n}" for i in range(len(model.model.layers)) for n in ("q_norm", "k_norm")]
    with torch.no_grad(), capture(hf(name), outputs_of=names) as (ref, _):
        hf(name)(torch.tensor([ids]))
    mine = probe(model, ids, outputs_of=names).outputs                 # q_norm: (T * H, D), as HF's
    rows = golden.compare(ref, mine)
    assert len(rows) == len(names) and golden.first_divergence(rows) is None, golden.report(rows)


def test_every_sublayer_matches_hfs_at_tp2(qwen3):
    ids = PROMPTS[0]
    ref = golden.hf_activations(qwen3("qwen3"), ids)                  # HF's Qwen3ForCausalLM, by model_type
    rows = golden.compare(ref, golden.tplab_activations(qwen3("qwen3"), ids, tensor_parallel_size=2))
    assert golden.first_divergence(rows) is None, golden.report(rows)


def test_without_the_per_head_norms_the_first_attention_differs(qwen3, monkeypatch):
    """The check can fail: Qwen2's attention (no q/k norms) on a Qwen3 checkpoint's other weights."""
    from tplab.models.qwen3 import Qwen3Attention
    ids = PROMPTS[1]
    ref = golden.hf_activations(qwen3("qwen3"), ids)
    monkeypatch.setattr(Qwen3Attention, "norm_heads", lambda self, q, k: (q, k))
    rows = golden.compare(ref, golden.tplab_activations(qwen3("qwen3"), ids))
    assert golden.first_divergence(rows) == "model.layers.0.self_attn"


def test_the_engine_takes_the_four_qwen_model_types_and_names_them_when_refusing(tmp_path, qwen3):
    assert set(MODELS) == {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
    assert load_model_config(qwen3("qwen3")).model_type == "qwen3"
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((qwen3("qwen3") / "model.safetensors").read_bytes())
    config = json.loads((qwen3("qwen3") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'; tplab runs Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE "
                       "checkpoints \\(model_type 'qwen2', 'qwen3', 'qwen2_moe', 'qwen3_moe'"):
        LLM(folder)
