"""Notebook 08's MoE pitfalls in ``tplab.bugs``, each with its fingerprint against HF: the first MoE block off where
the mistake bites, exact where it cannot (a config that hides it, a placement or TP size where it does nothing)."""
import pytest
import torch

from tplab import golden, models
from tplab.distributed.launcher import launch
from tplab.engine.config import engine_config

PROMPT = [3, 17, 42, 99, 5, 61, 200, 7, 150]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return models.save_random_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"), seed=2)   # norm_topk_prob true


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):                                                       # a shared expert
    return models.save_random_qwen2_moe(tmp_path_factory.mktemp("qwen2_moe"), seed=1)


def first_off(model_dir, **settings) -> str | None:
    """The first sublayer of one prefill through the engine with ``settings`` that differs from HF's."""
    cfg = engine_config(model_dir, device="cpu", **settings)
    mine = {}
    for acts in launch(golden.stage_activations, cfg.world_size, args=(cfg, PROMPT)):
        mine.update(acts or {})
    assert "model.layers.0.mlp" in mine, sorted(mine)            # a None below must have compared the MoE blocks
    ref = golden.hf_activations(model_dir, PROMPT)
    return golden.first_divergence(golden.compare({n: ref[n] for n in mine}, mine))


def test_not_renormalized_is_off_at_the_first_moe_block_at_tp1_and_hidden_by_norm_topk_prob_false(qwen3_moe, qwen2_moe):
    assert first_off(qwen3_moe, bugs=["moe_not_renormalized"]) == "model.layers.0.mlp"
    assert first_off(qwen2_moe, bugs=["moe_not_renormalized"]) is None      # norm_topk_prob false: nothing to drop


def test_global_ids_are_exact_while_every_rank_holds_every_expert_and_off_under_expert_parallelism(qwen3_moe):
    assert first_off(qwen3_moe, bugs=["moe_global_ids"], tensor_parallel_size=2) is None
    assert first_off(qwen3_moe, bugs=["moe_global_ids"], tensor_parallel_size=2,
                     enable_expert_parallel=True) == "model.layers.0.mlp"


def test_the_shared_expert_every_rank_is_exact_at_tp1_and_counted_t_times_at_tp2(qwen2_moe):
    assert first_off(qwen2_moe, bugs=["moe_shared_expert_every_rank"]) is None
    cfg = engine_config(qwen2_moe, device="cpu", tensor_parallel_size=2, bugs=["moe_shared_expert_every_rank"])
    mine = launch(golden.stage_activations, 2, args=(cfg, PROMPT))[0]
    from transformers import AutoModelForCausalLM
    from tplab.engine.probe import capture
    hf = AutoModelForCausalLM.from_pretrained(qwen2_moe, dtype=torch.float32).eval()
    names = ["model.layers.0.mlp", "model.layers.0.mlp.shared_expert", "model.layers.0.mlp.shared_expert_gate"]
    with torch.no_grad(), capture(hf, outputs_of=names) as (ref, _):
        hf(torch.tensor([PROMPT]))
    shared = torch.sigmoid(ref[names[2]]) * ref[names[1]]                 # the gated shared expert, (T, E)
    assert first_off(qwen2_moe, bugs=["moe_shared_expert_every_rank"], tensor_parallel_size=2) == names[0]
    assert golden.tolerance.within(mine[names[0]], ref[names[0]] + shared)  # HF's block + one more shared expert


def test_the_exchange_parts_are_handed_to_the_experts_class_once_and_compose_with_a_bug():
    import functools
    from tplab.bugs import NotRenormalizedMoE
    from tplab.engine.parts import resolve
    from tplab.layers.moe import FusedMoE

    def mine(x, ids, num_experts, ep_rank, ep_size):
        raise NotImplementedError
    parts = resolve(["moe_not_renormalized"], {"moe_dispatch": mine})
    assert isinstance(parts.experts, functools.partial) and parts.experts.func is NotRenormalizedMoE
    assert parts.experts.keywords == {"dispatch": mine, "combine": parts.moe_combine}
    again = resolve(parts=parts)                                      # a Parts resolved before: bound once, not twice
    assert again.experts.func is NotRenormalizedMoE and again.experts.keywords["dispatch"] is mine
    assert resolve().experts is FusedMoE                              # nothing replaced: nothing handed
    with pytest.raises(ValueError, match="called by tplab's FusedMoE"):
        resolve(parts={"moe_combine": mine, "experts": object})
