"""Weights packed for oneDNN by each layer's ``linear_method`` (``tplab.kernels.gemm``, as vLLM's CPU
backend does): the same outputs as the plain weights, the plain copy dropped (kept for the tied LM
head, whose weight is the embedding's), and a part that reads its own ``weight`` left alone."""
import pytest
import torch
import torch.nn.functional as F

from tplab.engine.probe import load_model
from tplab.kernels import gemm
from tplab.kernels.gemm import Gemm, onednn_available, packing_available
from tplab.layers.embed_head import ParallelLMHead
from tplab.layers.linear import LinearBase, RowParallelLinear
from tplab.layers.linear_method import hand_out_linear_methods

PACKING = Gemm(onednn=True, pack=True)
needs_packing = pytest.mark.skipif(not packing_available(), reason="oneDNN fp32 weight packing is not available here")
# oneDNN's bf16 inner product needs the CPU's bf16 support (AVX-512 or AVX-NE-CONVERT); an AVX2-only CPU has none
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN bf16 weight packing is not available on this CPU"))]


def pack_linear_weights(model):
    """Hand every linear layer its packing method (the LM head's is tested below); how many will pack. A
    weight is packed at its layer's first product through the method."""
    packs = 0
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            m.linear_method = PACKING.method_for(name)
            packs += m.linear_method.process_weights_after_loading(m)
    return packs


def pack_lm_head(head):
    head.linear_method = PACKING.method_for("lm_head")
    return head.linear_method.process_weights_after_loading(head)


def run_layers(model, x):
    """Every tplab linear layer of the first decoder layer on ``x`` (no collectives: TP 1)."""
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj(x)
    gate_up = layer.mlp.gate_up_proj(x)
    return [qkv, layer.self_attn.o_proj(qkv[:, :layer.self_attn.o_proj.weight.shape[1]]), gate_up,
            layer.mlp.down_proj(gate_up[:, :layer.mlp.down_proj.weight.shape[1]])]


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_layers_give_the_plain_layers_outputs(checkpoint, dtype):
    model = load_model(checkpoint("gqa"), dtype=dtype)
    x = torch.randn(5, model.config.hidden_size).to(getattr(torch, dtype))
    plain = run_layers(model, x)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    assert pack_linear_weights(model) == 4 * model.config.num_hidden_layers    # qkv, o, gate_up, down
    packed = run_layers(model, x)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.device.type == "meta" and layer.linear_method.packed.is_mkldnn   # the plain copy is gone
    assert {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()} == shapes   # param_bytes unchanged
    assert model.model.embed_tokens.weight.device.type == "cpu"                  # the embedding is not packed


@needs_packing
def test_a_part_that_reads_its_weight_is_not_packed(checkpoint):
    class MyRow(RowParallelLinear):
        def forward(self, x):
            return x @ self.weight.T                                # reads self.weight: must keep it

    model = load_model(checkpoint("gqa"), parts={"row_linear": MyRow})
    pack_linear_weights(model)
    run_layers(model, torch.randn(5, model.config.hidden_size))    # every layer's first product
    down = model.model.layers[0].mlp.down_proj
    assert down.linear_method.packed is None and down.weight.device.type == "cpu"
    assert model.model.layers[0].mlp.gate_up_proj.linear_method.packed is not None


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lm_head_packs_a_copy_when_needed_and_gives_the_same_logits(checkpoint, dtype):
    model = load_model(checkpoint("gqa"), dtype=dtype)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = [torch.randn(rows, model.config.hidden_size).to(getattr(torch, dtype)) for rows in (1, 2, 3, 16)]
    plain = [model.compute_logits(h) for h in hidden]
    assert pack_lm_head(model.lm_head) and model.lm_head.linear_method.packed is None    # nothing made yet
    tol = 1e-5 if dtype == "float32" else 2e-2
    for h, before in zip(hidden, plain):
        torch.testing.assert_close(model.compute_logits(h).float(), before.float(), rtol=tol, atol=tol)
        made = model.lm_head.linear_method.packed is not None
        assert made == (dtype == "bfloat16" or h.shape[0] >= 3), f"{h.shape[0]} rows of {dtype}: copy made {made}"
    assert model.lm_head.linear_method.packed.is_mkldnn
    assert model.lm_head.weight is model.model.embed_tokens.weight            # the lookup keeps its rows


@needs_packing
def test_the_engine_processes_every_gemm_layer(checkpoint):
    model = load_model(checkpoint("gqa"))
    assert hand_out_linear_methods(model, PACKING) == 4 * model.config.num_hidden_layers + 1   # + the head


@needs_packing
def test_a_replacement_head_gets_no_packed_copy(checkpoint):
    class MyHead(ParallelLMHead):
        def forward(self, hidden, gather_output=True):
            return hidden @ self.weight.T

    model = load_model(checkpoint("gqa"), parts={"lm_head": MyHead})
    pack_lm_head(model.lm_head)
    model.compute_logits(torch.randn(16, model.config.hidden_size))   # 16 rows: tplab's head would pack
    assert model.lm_head.linear_method.packed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_is_chosen_for_the_models_dtype_and_multiplies_in_it(dtype):
    chosen = Gemm.choose(onednn=True, pack=True, dtype=dtype)
    assert (chosen.onednn, chosen.pack) == (onednn_available(dtype), packing_available(dtype))
    x, w = torch.randn(5, 64).to(dtype), torch.randn(48, 64).to(dtype)
    weight = chosen.packed(w) if chosen.can_pack(w) else w
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chosen.linear(x, weight).float(), F.linear(x, w).float(), rtol=tol, atol=tol)


@pytest.fixture
def cpu_without_onednn_bf16(monkeypatch):
    """This machine as an AVX2-only CPU: oneDNN refuses bf16 (as torch does there), fp32 as before."""
    real = {name: getattr(torch.ops.mkldnn, name) for name in ("_linear_pointwise", "_reorder_linear_weight")}

    def refusing(name):
        def op(x, *args):
            if x.dtype == torch.bfloat16:
                raise RuntimeError(f"{name}: bf16 path needs the cpu support avx_ne_convert or avx512bw")
            return real[name](x, *args)
        return op
    for name in real:
        monkeypatch.setattr(torch.ops.mkldnn, name, refusing(name))
    for probe in (gemm.onednn_available, gemm.packing_available):
        probe.cache_clear()
    yield
    monkeypatch.undo()
    for probe in (gemm.onednn_available, gemm.packing_available):
        probe.cache_clear()


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available here")
def test_without_onednn_bf16_fp32_still_packs_and_a_bf16_model_multiplies_as_hf(checkpoint, cpu_without_onednn_bf16):
    """The bf16 engine asked for oneDNN multiplies with ``F.linear``, as HF: bit for bit the tokens and logprobs
    of an engine told not to use oneDNN, every logprob finite, and HF bf16's greedy tokens with logprobs within
    the bf16 bound (another token than HF's only where HF's pick led by no more than that bound: a near-tie)."""
    from transformers import AutoModelForCausalLM
    from tplab import LLM, SamplingParams, tolerance
    from tplab.golden import hf_greedy_tokens
    fp32 = Gemm.choose(True, True, torch.float32)
    assert (fp32.onednn, fp32.pack) == (True, packing_available())                  # fp32 keeps its path
    assert Gemm.choose(True, True, torch.bfloat16) == Gemm(False, False)              # bf16: F.linear, as HF
    prompts, n, runs = [[1, 2, 3], [5, 17, 42, 9, 77, 3, 120]], 6, {}
    for onednn in (True, False):                                 # True raised in every linear layer before
        with LLM(checkpoint("gqa"), dtype="bfloat16", onednn=onednn) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            runs[onednn] = [(o.token_ids, o.logprobs) for o in outs]
    assert runs[True] == runs[False]                             # the plain F.linear engine's, bit for bit
    hf = AutoModelForCausalLM.from_pretrained(checkpoint("gqa"), dtype=torch.bfloat16).eval()
    for prompt, (tokens, logprobs) in zip(prompts, runs[True]):
        assert len(tokens) == n and torch.isfinite(torch.tensor(logprobs)).all(), logprobs
        ref = hf_greedy_tokens(hf, [prompt], n)[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref])).logits[0].float()
        bound = tolerance.logprob_bound(logits, torch.bfloat16)
        hf_logprobs = logits[len(prompt) - 1:-1].log_softmax(-1)                           # (n, V)
        top2 = hf_logprobs.topk(2).values
        parts = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), n)        # HF's context until
        worst = max([0.0] + [abs(logprobs[i] - hf_logprobs[i, t].item()) for i, t in enumerate(ref[:parts])])
        assert worst <= bound, f"{prompt}: logprob off by {worst:.3f} from HF bf16, bound {bound:.3f}"
        assert parts == n or top2[parts, 0] - top2[parts, 1] <= bound, f"{prompt}: {tokens} vs HF's {ref}"


# MKL for products of a few rows (``Gemm.few_rows_mkl``), on the layers that keep their weights plain for it
FEW_ROWS_MKL = Gemm(onednn=True, pack=True, few_rows_mkl=True)
needs_mkl = pytest.mark.skipif(not (packing_available() and torch.backends.mkl.is_available()),
                               reason="needs oneDNN fp32 packing and a torch built with MKL")


@needs_mkl
def test_a_few_rows_by_a_plain_weight_go_to_mkl_and_the_rest_to_onednn():
    w, bias = torch.randn(48, 64), torch.randn(48)
    packed = FEW_ROWS_MKL.packed(w)
    onednn = lambda x, weight: torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 64)
        mkl = rows <= gemm.FEW_ROWS
        assert torch.equal(FEW_ROWS_MKL.linear(x, w, bias), F.linear(x, w, bias) if mkl else onednn(x, w)), rows
        assert torch.equal(FEW_ROWS_MKL.linear(x, packed, bias), onednn(x, packed)), f"{rows} rows, packed weight"
        assert FEW_ROWS_MKL.mkl_takes(x, w) == mkl and not FEW_ROWS_MKL.mkl_takes(x, packed)
        assert not PACKING.mkl_takes(x, w)                                       # off unless asked


@needs_mkl
def test_with_mkl_for_few_rows_qkv_o_and_down_stay_plain_gate_up_packs_and_outputs_hold(checkpoint):
    model = load_model(checkpoint("gqa"), few_rows_mkl=False)      # the reference: oneDNN at every row count
    xs = [torch.randn(rows, model.config.hidden_size) for rows in (1, 2, 5)]
    plain = [run_layers(model, x) for x in xs]
    assert hand_out_linear_methods(model, FEW_ROWS_MKL) == model.config.num_hidden_layers + 1   # gate_up, head
    for x, before in zip(xs, plain):
        for a, b in zip(run_layers(model, x), before):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    layer = model.model.layers[0]
    for kept in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert kept.linear_method.packed is None and kept.weight.device.type == "cpu", type(kept).__name__
    assert layer.mlp.gate_up_proj.linear_method.packed.is_mkldnn


@pytest.fixture
def vendor(monkeypatch):
    """``vendor(name)``: this machine as a CPU of that vendor for ``Gemm.choose``."""
    def be(name):
        monkeypatch.setattr(gemm, "cpu_vendor", lambda: name)
        gemm.mkl_fast_here.cache_clear()
    yield be
    monkeypatch.undo()
    gemm.mkl_fast_here.cache_clear()


@needs_mkl
def test_mkl_for_few_rows_is_chosen_on_intel_in_fp32_beside_onednn_only(vendor):
    vendor("GenuineIntel")
    assert Gemm.choose(True, True, torch.float32) == FEW_ROWS_MKL
    assert not Gemm.choose(True, True, torch.float32, few_rows_mkl=False).few_rows_mkl      # TPLAB_FEW_ROWS_MKL=0
    assert not Gemm.choose(False, True, torch.float32).few_rows_mkl       # without oneDNN all is F.linear already
    assert not Gemm.choose(True, True, torch.bfloat16).few_rows_mkl       # MKL's bf16 products are slow
    vendor("AuthenticAMD")                                                # MKL's generic path: half the bandwidth
    assert Gemm.choose(True, True, torch.float32) == PACKING


@pytest.mark.parametrize("processor, want", [
    ("Intel64 Family 6 Model 85 Stepping 7, GenuineIntel", "GenuineIntel"),     # what Windows says
    ("AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD", "AuthenticAMD"),
    ("arm", "")])
def test_without_proc_cpuinfo_the_vendor_comes_from_the_processor_name(monkeypatch, processor, want):
    def no_file(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")
    monkeypatch.setattr("builtins.open", no_file)
    monkeypatch.setattr(gemm.platform, "processor", lambda: processor)
    assert gemm.cpu_vendor() == want


@needs_mkl
def test_an_engine_with_mkl_for_few_rows_matches_hf_alone_and_batched(checkpoint, hf_model, vendor, monkeypatch):
    """Greedy decoding of one sequence (one-row products: MKL) and of three (oneDNN) against HF, with the
    path on whatever CPU runs the test (its choice is the vendor's; forced here)."""
    from conftest import hf_greedy
    from tplab import LLM, SamplingParams
    vendor("GenuineIntel")
    prompts, params = [[3, 17, 42, 99, 5], [250, 7], list(range(40, 71))], SamplingParams(temperature=0.0, max_tokens=10)
    refs = [hf_greedy(hf_model(checkpoint("gqa")), p, 10) for p in prompts]
    to_mkl = []
    takes = Gemm.mkl_takes
    monkeypatch.setattr(Gemm, "mkl_takes", lambda self, x, w: to_mkl.append(takes(self, x, w)) or to_mkl[-1])
    with LLM(checkpoint("gqa")) as llm:                            # TP 1 runs in this process: the vendor holds
        outs = [llm.generate([prompts[0]], params)[0]]
        alone = sum(to_mkl)
        outs += llm.generate(prompts, params)
    layers = llm.config.hf_config.num_hidden_layers
    assert alone >= 9 * (3 * layers + 1), alone               # 9 decode steps x (qkv, o, down a layer; the head)
    for out, ref in zip(outs, refs[:1] + refs, strict=True):
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1], strict=True)) <= ref.bound


@needs_packing
def test_an_engine_of_one_sequence_keeps_plain_fp32_weights_on_amd_and_matches_hf(checkpoint, hf_model, vendor,
                                                                                    monkeypatch):
    """``max_num_seqs=1``: every decode step is one row, which oneDNN streams faster from the plain layout on
    AMD (not on Intel, not in bf16, not with two sequences a step). The choice, and the tokens against HF."""
    from conftest import hf_greedy
    from tplab import LLM, SamplingParams
    from tplab.engine import llm_engine
    vendor("GenuineIntel")
    assert not gemm.one_row_keeps_plain(torch.float32, 1)
    vendor("AuthenticAMD")
    assert gemm.one_row_keeps_plain(torch.float32, 1)
    assert not gemm.one_row_keeps_plain(torch.float32, 2) and not gemm.one_row_keeps_plain(torch.bfloat16, 1)
    assert not Gemm.choose(True, True, torch.float32, max_num_seqs=1).pack
    assert Gemm.choose(True, True, torch.float32, max_num_seqs=2).pack and Gemm.choose(True, True).pack
    chosen, process = [], llm_engine.hand_out_linear_methods
    monkeypatch.setattr(llm_engine, "hand_out_linear_methods",
                        lambda model, methods: chosen.append(methods) or process(model, methods))
    prompts, params = [[3, 17, 42, 99, 5], list(range(40, 71))], SamplingParams(temperature=0.0, max_tokens=10)
    for seqs, packs in ((1, False), (2, True)):
        with LLM(checkpoint("gqa"), max_num_seqs=seqs) as llm:        # TP 1 runs in this process: the vendor holds
            outs = llm.generate(prompts, params)
        assert chosen[-1].onednn and chosen[-1].pack == packs, (seqs, chosen[-1])
        for prompt, out in zip(prompts, outs, strict=True):
            ref = hf_greedy(hf_model(checkpoint("gqa")), prompt, 10)
            assert out.token_ids == ref[0], seqs
            assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound
