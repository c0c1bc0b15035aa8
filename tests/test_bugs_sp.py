"""Notebook 07's sequence-parallel pitfalls (``tplab.bugs``: ``sp_scatter_hidden``, ``sp_norm_twice``), each with its
fingerprint in the per-sublayer diff against HF (golden gathers SP's activations back to all T tokens)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tplab import golden
from tplab.engine.config import engine_config

PROMPT = [3, 17, 42, 99, 5, 61, 200, 7, 150]                      # 9 tokens: padded to 10 at TP 2, 12 at TP 4


@pytest.fixture(scope="module")
def untied(checkpoint, hf_model):
    folder = checkpoint("untied")
    return folder, hf_model(folder), golden.hf_activations(hf_model(folder), PROMPT)


def sp_rows(folder, reference, bug, tp):
    mine = golden.tplab_activations(folder, PROMPT, tp, bugs=[bug], sequence_parallel=True)
    return golden.compare(reference, mine), mine


def test_without_a_bug_sequence_parallel_matches_hf_sublayer_by_sublayer(untied):
    folder, _, ref = untied
    rows = golden.compare(ref, golden.tplab_activations(folder, PROMPT, 2, sequence_parallel=True))
    assert golden.first_divergence(rows) is None, golden.report(rows)


@pytest.mark.parametrize("tp", [2, 4])
def test_scatter_on_the_hidden_dim_scrambles_the_residual_before_the_first_norm(untied, tp):
    folder, _, ref = untied
    rows, mine = sp_rows(folder, ref, "sp_scatter_hidden", tp)
    assert rows[0].name == "model.embed_tokens" and rows[0].ok      # the lookups themselves are right...
    assert golden.first_divergence(rows) == "model.layers.0.input_layernorm"   # ...their scatter is not
    assert all(r.nonfinite == 0 for r in rows) and rows[1].max_abs > 100 * rows[1].bound   # no NaN, and no rounding
    # at TP 1 there is nothing to scatter: the region never runs, and the engine says so rather than look right
    with pytest.raises(ValueError, match=r"bug 'sp_scatter_hidden' replaces Parts.sp_norm_region, which this engine "
                                         r"never uses: it runs only with sequence_parallel=True at tensor_parallel_size > 1"):
        engine_config(folder, bugs=["sp_scatter_hidden"], sequence_parallel=True)


def test_norm_twice_holds_hfs_norm_normed_again(untied):
    folder, hf, ref = untied
    rows, mine = sp_rows(folder, ref, "sp_norm_twice", 2)
    assert golden.first_divergence(rows) == "model.layers.0.input_layernorm"
    with torch.no_grad():
        again = hf.model.layers[0].input_layernorm(ref["model.layers.0.input_layernorm"])
    assert golden.cmp("norm(HF's input_layernorm)", mine["model.layers.0.input_layernorm"], again)


def test_norm_twice_hides_when_every_norm_weight_is_one(untied, tmp_path):
    """A freshly initialised model's RMSNorm weights are ones: norm(norm(x)) = norm(x) up to eps."""
    folder, _, _ = untied
    ones = tmp_path / "ones"
    shutil.copytree(folder, ones)
    tensors = load_file(ones / "model.safetensors")
    save_file({k: torch.ones_like(v) if "norm" in k else v for k, v in tensors.items()}, ones / "model.safetensors")
    ref = golden.hf_activations(str(ones), PROMPT)
    rows, _ = sp_rows(str(ones), ref, "sp_norm_twice", 2)
    assert golden.first_divergence(rows) is None, golden.report(rows)
