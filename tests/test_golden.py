"""Per-layer golden comparison against HF: exact where it should be, and it points at the broken sublayer."""
import pytest
import torch

from tplab import golden

PROMPT = [3, 17, 42, 99, 5, 61, 200, 7, 150]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return golden.hf_activations(checkpoint("untied"), PROMPT)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_sublayer_matches_hf(checkpoint, reference, tp):
    rows = golden.compare(reference, golden.tplab_activations(checkpoint("untied"), PROMPT, tp))
    assert [r.name for r in rows] == golden.activation_names(3) and len(rows) == 3 * 5 + 3
    assert golden.first_divergence(rows) is None, golden.report(rows)


@pytest.mark.parametrize("bug", ["mask_mul_inf", "no_rope"])
def test_a_bug_is_found_at_the_first_attention(checkpoint, reference, bug):
    rows = golden.compare(reference, golden.tplab_activations(checkpoint("untied"), PROMPT, 1, bugs=[bug]))
    assert golden.first_divergence(rows) == "model.layers.0.self_attn"
    assert all(r.max_abs == 0 for r in rows[:2])                    # embedding and first norm untouched
    if bug == "mask_mul_inf":
        assert rows[2].nonfinite > 0                                 # NaN from 0 * -inf


@pytest.mark.parametrize("set_it", [
    lambda: torch.set_float32_matmul_precision("medium"),               # bf16 in oneDNN on an AMX CPU
    lambda: torch.set_float32_matmul_precision("high"),                 # tf32 on CUDA
    lambda: setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16"),
], ids=["legacy medium", "legacy high", "mkldnn bf16"])
def test_a_reference_is_refused_while_fp32_matmuls_may_round(checkpoint, set_it):
    # On an AMX Xeon "medium" made HF and tplab agree to the last bit, both in bf16: a diff that sees nothing
    set_it()
    try:
        with pytest.raises(RuntimeError, match=r"set_float32_matmul_precision\('highest'\)"):
            golden.hf_activations(checkpoint("untied"), PROMPT)
    finally:
        torch.set_float32_matmul_precision("highest")                   # every backend's matmuls: ieee
    golden.hf_activations(checkpoint("untied"), PROMPT)                 # and taken again once it is reset


def test_before_torch_2_9_the_one_legacy_setting_is_read(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "matmul", object(), raising=False)   # torch < 2.9: no fp32_precision
    golden.require_float32_matmuls()
    torch.set_float32_matmul_precision("medium")
    try:
        with pytest.raises(RuntimeError, match=r"float32_matmul_precision: medium"):
            golden.require_float32_matmuls()
    finally:
        torch.set_float32_matmul_precision("highest")
