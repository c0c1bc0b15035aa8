"""Weights packed for oneDNN after loading (``process_weights_after_loading``, as vLLM's CPU
backend does): the same outputs as the plain weights, the plain copy dropped (kept for the tied LM
head, whose weight is the embedding's), and a part that reads its own ``weight`` left alone."""
import pytest
import torch
import torch.nn.functional as F

from tplab.engine.probe import load_model
from tplab.layers import cpu_gemm
from tplab.layers.cpu_gemm import Gemm, onednn_available, packing_available, process_weights_after_loading
from tplab.layers.embed_head import ParallelLMHead
from tplab.layers.linear import LinearBase, RowParallelLinear

PACKING = Gemm(onednn=True, pack=True)
needs_packing = pytest.mark.skipif(not packing_available(), reason="oneDNN fp32 weight packing is not available here")
# oneDNN's bf16 inner product needs the CPU's bf16 support (AVX-512 or AVX-NE-CONVERT); an AVX2-only CPU has none
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN bf16 weight packing is not available on this CPU"))]


def pack_linear_weights(model):
    """Process every linear layer (the LM head packs on demand, tested below); how many packed."""
    return sum(m.process_weights_after_loading(PACKING) for m in model.modules()
               if isinstance(m, LinearBase))


def pack_lm_head(head):
    return head.process_weights_after_loading(PACKING)


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
    assert layer.weight.device.type == "meta" and layer.packed_weight.is_mkldnn   # the plain copy is gone
    assert {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()} == shapes   # param_bytes unchanged
    assert model.model.embed_tokens.weight.device.type == "cpu"                  # the embedding is not packed


@needs_packing
def test_a_part_that_reads_its_weight_is_not_packed(checkpoint):
    class MyRow(RowParallelLinear):
        def forward(self, x):
            return x @ self.weight.T                                # reads self.weight: must keep it

    model = load_model(checkpoint("gqa"), parts={"row_linear": MyRow})
    pack_linear_weights(model)
    down = model.model.layers[0].mlp.down_proj
    assert down.packed_weight is None and down.weight.device.type == "cpu"
    assert model.model.layers[0].mlp.gate_up_proj.packed_weight is not None


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lm_head_packs_a_copy_when_needed_and_gives_the_same_logits(checkpoint, dtype):
    model = load_model(checkpoint("gqa"), dtype=dtype)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = [torch.randn(rows, model.config.hidden_size).to(getattr(torch, dtype)) for rows in (1, 2, 3, 16)]
    plain = [model.compute_logits(h) for h in hidden]
    assert pack_lm_head(model.lm_head) and model.lm_head.packed_weight is None    # nothing made yet
    tol = 1e-5 if dtype == "float32" else 2e-2
    for h, before in zip(hidden, plain):
        torch.testing.assert_close(model.compute_logits(h).float(), before.float(), rtol=tol, atol=tol)
        made = model.lm_head.packed_weight is not None
        assert made == (dtype == "bfloat16" or h.shape[0] >= 3), f"{h.shape[0]} rows of {dtype}: copy made {made}"
    assert model.lm_head.packed_weight.is_mkldnn
    assert model.lm_head.weight is model.model.embed_tokens.weight            # the lookup keeps its rows


@needs_packing
def test_the_engine_processes_every_gemm_layer(checkpoint):
    model = load_model(checkpoint("gqa"))
    assert process_weights_after_loading(model, PACKING) == 4 * model.config.num_hidden_layers + 1   # + the head


@needs_packing
def test_a_replacement_head_gets_no_packed_copy(checkpoint):
    class MyHead(ParallelLMHead):
        def forward(self, hidden, gather_output=True):
            return hidden @ self.weight.T

    model = load_model(checkpoint("gqa"), parts={"lm_head": MyHead})
    assert not pack_lm_head(model.lm_head)
    model.compute_logits(torch.randn(16, model.config.hidden_size))
    assert model.lm_head.packed_weight is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_is_chosen_for_the_models_dtype_and_multiplies_in_it(dtype):
    gemm = Gemm.choose(onednn=True, pack=True, dtype=dtype)
    assert (gemm.onednn, gemm.pack) == (onednn_available(dtype), packing_available(dtype))
    x, w = torch.randn(5, 64).to(dtype), torch.randn(48, 64).to(dtype)
    weight = gemm.packed(w) if gemm.can_pack(w) else w
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gemm.linear(x, weight).float(), F.linear(x, w).float(), rtol=tol, atol=tol)


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
    for probe in (cpu_gemm.onednn_available, cpu_gemm.packing_available):
        probe.cache_clear()
    yield
    monkeypatch.undo()
    for probe in (cpu_gemm.onednn_available, cpu_gemm.packing_available):
        probe.cache_clear()


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available here")
def test_without_onednn_bf16_fp32_still_packs_and_a_bf16_model_multiplies_as_hf(checkpoint, cpu_without_onednn_bf16):
    assert Gemm.choose(True, True, torch.float32) == Gemm(True, packing_available())   # fp32 keeps its path
    assert Gemm.choose(True, True, torch.bfloat16) == Gemm(False, False)              # bf16: F.linear, as HF
    from tplab import LLM, SamplingParams
    with LLM(checkpoint("gqa"), dtype="bfloat16") as llm:        # raised in every linear layer before
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.token_ids) == 4
