"""Qwen2-MoE and Qwen3-MoE in the engine, against HF's own MoE models: greedy tokens equal HF's and logprobs are
within the fp32 bound at TP 1, 2, 4, each expert split by TP or whole experts on each rank
(``enable_expert_parallel``), with chunked prefill, prefix-cache hits and preemption in the same run; every
sublayer (the router's logits, the routed experts, the shared expert and its gate) against HF's; the split is
checked before any rank starts; and a wrong MoE part is seen."""
import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, golden, models
from tplab.distributed.launcher import launch
from tplab.engine.config import engine_config
from tplab.engine.probe import capture, load_model, probe
from tplab.layers.moe import FusedMoE

MAX_TOKENS = 8
SHARED = list(range(60, 100))                                       # a 40-token prefix
PROMPTS = [list(range(1, 70)), [3, 17, 42], SHARED + [1, 2, 3], [250, 7] * 20, SHARED + [4], [9]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# 14 blocks of 8 tokens for 6 prompts (one of 69 tokens), 16 tokens a step: chunks, prefix hits, preemption
TIGHT = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True)
MODELS = {   # each with what HF's config makes of it
    "qwen2_moe": lambda d: models.save_random_qwen2_moe(d, seed=1, num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen3_moe": lambda d: models.save_random_qwen3_moe(d, seed=2),   # norm_topk_prob=True, q/k norms
}
FINE = ("gate", "experts", "shared_expert", "shared_expert_gate")   # inside an MoE block, HF's names


@pytest.fixture(scope="module")
def hf(hf_model, moe):
    """``hf(name)`` -> HF's own model on checkpoint ``name`` (conftest's ``hf_model``)."""
    return lambda name: hf_model(moe(name))


@pytest.fixture(scope="module")
def reference(hf):
    cache = {}

    def ref(name):
        if name not in cache:
            cache[name] = [hf_greedy(hf(name), p, MAX_TOKENS) for p in PROMPTS]
        return cache[name]
    return ref


def assert_matches_hf(outs, reference, what):
    assert len(outs) == len(reference) == len(PROMPTS), what
    for out, ref, prompt in zip(outs, reference, PROMPTS):
        tokens, logprobs = ref
        assert out.token_ids == tokens, f"{what}: tokens differ from HF for a prompt of {len(prompt)} tokens"
        worst = max(abs(a - b) for a, b in zip(out.logprobs, logprobs))
        assert worst <= ref.bound, f"{what}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"
    assert len({t for tokens, _ in reference for t in tokens}) >= 8, "HF's own output is too weak a reference"


RUNS = [dict(tensor_parallel_size=1), dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, enable_expert_parallel=True), dict(tensor_parallel_size=4),
        dict(tensor_parallel_size=4, enable_expert_parallel=True)]


SHORT = {"tensor_parallel_size": "tp", "enable_expert_parallel": "ep"}


@pytest.mark.parametrize("settings", RUNS, ids=lambda s: "-".join(f"{SHORT[k]}{v}" for k, v in s.items()))
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_hf_with_chunks_prefix_hits_and_preemption(name, settings, moe, reference):
    with LLM(moe(name), **settings, **TIGHT) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert_matches_hf(outs, reference(name), f"{name} {settings}")
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0, stats
    assert stats["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("settings", [dict(sequence_parallel=True), dict(pipeline_parallel_size=2)],
                         ids=["sp", "pp2"])
def test_expert_parallel_composes_with_sequence_and_pipeline_parallelism(settings, moe, reference):
    blocks = dict(TIGHT, num_kv_blocks=28) if "pipeline_parallel_size" in settings else TIGHT   # 14 per batch
    with LLM(moe("qwen2_moe"), tensor_parallel_size=2, enable_expert_parallel=True, **settings, **blocks) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.stats()["prefix_cache_hit_blocks"] > 0
    assert_matches_hf(outs, reference("qwen2_moe"), f"tp2 ep {settings}")


def moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_sublayer_inside_the_moe_block_matches_hfs_at_tp1(name, moe, hf):
    """The router's logits, the routed experts' sum, the shared expert and its gate, then every sublayer."""
    ids = PROMPTS[0][:24]
    mine_model = load_model(moe(name))
    layers = moe_layers(mine_model)
    assert layers == moe_layers(hf(name)) == ([0, 2] if name == "qwen2_moe" else [0, 1])   # mlp_only_layers=[1]
    names = golden.activation_names(len(mine_model.model.layers))[:-1] + \
        [f"model.layers.{i}.mlp.{s}" for i in layers for s in FINE if getattr(mine_model.model.layers[i].mlp, s)]
    with torch.no_grad(), capture(hf(name), outputs_of=names) as (ref, _):
        hf(name)(torch.tensor([ids]))
    mine = probe(mine_model, ids, outputs_of=names).outputs
    assert len(ref) == len(names) == len(mine) and any("shared_expert_gate" in n for n in names) == (name == "qwen2_moe")
    rows = golden.compare(ref, mine)
    assert golden.first_divergence(rows) is None, golden.report(rows)


def engine_activations(model_dir, ids, **settings) -> dict[str, torch.Tensor]:
    """Every sublayer of one prefill through the engine with ``settings``, from the rank(s) that own it."""
    cfg = engine_config(model_dir, device="cpu", max_num_batched_tokens=64, **settings)
    merged = {}
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    for acts in launch(golden.stage_activations, world, args=(cfg, list(ids))):
        merged.update(acts or {})
    return merged


@pytest.mark.parametrize("settings", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                      dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2-ep", "tp2-pp2-ep"])
def test_every_sublayer_matches_hfs_at_tp2(settings, moe):
    ids = PROMPTS[3]
    ref = golden.hf_activations(moe("qwen2_moe"), ids)              # HF's Qwen2MoeForCausalLM, by model_type
    mine = engine_activations(moe("qwen2_moe"), ids, **settings)
    assert len(mine) >= 14                                           # every layer's sublayers, the norm
    rows = golden.compare({n: ref[n] for n in mine}, mine)
    assert golden.first_divergence(rows) is None, golden.report(rows)


def test_the_split_is_checked_before_any_rank_starts(tmp_path, no_new_children):
    six = models.save_random_qwen3_moe(tmp_path / "six", num_experts=6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not work: enable_expert_parallel=True places "
                       r"whole experts on the 4 ranks, and the 6 experts \(num_experts\) do not divide by 4. "
                       r"TP sizes that work: \[1, 2\]; or drop enable_expert_parallel"):
        LLM(six, tensor_parallel_size=4, enable_expert_parallel=True)
    assert engine_config(six, tensor_parallel_size=4).tensor_parallel_size == 4   # each expert split: 32 / 4
    odd = models.save_random_qwen2_moe(tmp_path / "odd", moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size 30 is not divisible by 4. TP sizes that work: "
                                         r"\[1, 2\]; or enable_expert_parallel=True \(whole experts on each rank"):
        LLM(odd, tensor_parallel_size=4)
    assert engine_config(odd, tensor_parallel_size=4, enable_expert_parallel=True).enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False"):
        LLM(six, enable_expert_parallel="yes")


class TopKNotRenormalized(FusedMoE):
    """A mistake: the top-k weights as the softmax left them, whatever ``norm_topk_prob`` says."""

    def select_experts(self, router_logits, dtype):
        weights, ids = torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        return weights.to(dtype), ids


class UnweightedCombine(FusedMoE):
    """A mistake: each expert's output summed without its routing weight."""

    def select_experts(self, router_logits, dtype):
        weights, ids = super().select_experts(router_logits, dtype)
        return torch.ones_like(weights), ids


@pytest.mark.parametrize("part", [TopKNotRenormalized, UnweightedCombine])
def test_a_wrong_experts_part_is_seen_at_the_first_moe_block(part, moe):
    ids = PROMPTS[2]
    ref = golden.hf_activations(moe("qwen3_moe"), ids)
    rows = golden.compare(ref, golden.tplab_activations(moe("qwen3_moe"), ids, parts={"experts": part}))
    assert golden.first_divergence(rows) == "model.layers.0.mlp"


def test_a_cpu_step_of_an_moe_model_holds_2048_tokens(moe):
    """A prompt cut into chunks reads every expert's weights once a chunk: on CPU an MoE model's default step is
    2048 tokens, a dense model's 512 (a Qwen2-MoE config whose every layer is dense counts as dense)."""
    from tplab.engine.config import default_batched_tokens
    from tplab.models.checkpoints import SMALL_QWEN2
    from tplab.models.registry import load_model_config
    from transformers import Qwen2Config, Qwen2MoeConfig
    moe_config = load_model_config(moe("qwen3_moe"))
    all_dense = Qwen2MoeConfig(**{**SMALL_QWEN2, "num_experts": 8, "mlp_only_layers": [0, 1]})
    assert default_batched_tokens("cpu", moe_config) == 2048
    assert default_batched_tokens("cpu", Qwen2Config(**SMALL_QWEN2)) == default_batched_tokens("cpu", all_dense) == 512
    assert default_batched_tokens("cuda", moe_config) == 4096
    with LLM(moe("qwen3_moe")) as llm:
        assert llm._worker.engine.scheduler.max_num_batched_tokens == 2048
