"""golden.pipeline_activations: every sublayer of a pipeline-parallel engine, each from the stage that owns it,
against HF; and pp_residual_not_sent's fingerprint in that diff (notebook 07)."""
import pytest
import torch

from tplab import golden, models

IDS = list(range(5, 18))


@pytest.fixture(scope="module")
def shipped(hf_model):
    hf = hf_model(models.tiny_stories())                              # 4 layers: stages [0, 1] and [2, 3] at PP 2
    return hf, golden.hf_activations(hf, IDS)


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2), (1, 4)])
def test_every_owned_sublayer_matches_hf(shipped, tp, pp):
    _, ref = shipped
    mine = golden.pipeline_activations(models.tiny_stories(), IDS, tp, pp)
    # all but the logits and each sending stage's last layer output (its sum is made by the next stage)
    assert len(mine) == len(ref) - 1 - (pp - 1)
    rows = golden.compare({n: ref[n] for n in mine}, mine)
    assert golden.first_divergence(rows) is None, golden.report(rows)


def test_residual_not_sent_starts_stage_1_from_the_mlp_output_alone(shipped):
    hf, ref = shipped
    mine = golden.pipeline_activations(models.tiny_stories(), IDS, 1, 2, bugs=["pp_residual_not_sent"])
    rows = golden.compare({n: ref[n] for n in mine}, mine)
    assert golden.first_divergence(rows) == "model.layers.2.input_layernorm"
    with torch.no_grad():                       # stage 1's first norm saw layer 1's MLP output, not residual + it
        want = hf.model.layers[2].input_layernorm(ref["model.layers.1.mlp"])
    assert golden.cmp("stage 1's first norm", mine["model.layers.2.input_layernorm"], want)
