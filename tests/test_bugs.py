"""Each pitfall of the review notes in ``tplab.bugs`` leaves its own fingerprint against HF, and nothing else changes."""
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy
from tplab import LLM, SamplingParams, bugs, golden, models
from tplab.distributed.launcher import RankError
from tplab.engine.probe import load_model
from tplab.layers.weights import WeightShapeError

PROMPT = [3, 17, 42, 99, 5, 61, 200, 7, 150]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return golden.hf_activations(checkpoint("untied"), PROMPT)


def bug_rows(checkpoint, reference, names, tp=1):
    return golden.compare(reference, golden.tplab_activations(checkpoint("untied"), PROMPT, tp, bugs=names))


def test_names_cover_the_pitfalls_of_the_review_notes_and_say_which():
    assert set(bugs.NAMES) == {"mask_mul_inf", "no_mask_with_cache",
                               "no_rope", "rope_layout", "rope_cos_sin_axis", "rope_swallowed",
                               "shard_dim1", "qkv_presized", "kv_cache_repeated", "decode_position_offby1",
                               "lm_head_missing", "lm_head_random", "full_load_per_rank",
                               "sp_scatter_hidden", "sp_norm_twice", "pp_residual_not_sent", "pp_kv_every_layer",
                               "moe_not_renormalized", "moe_global_ids", "moe_shared_expert_every_rank",
                               "graph_stale_inputs"}
    sp = {name for name in bugs.NAMES if name.startswith("sp_")}    # notebook 07's: from real SP code (test_bugs_sp)
    real = {name for name in bugs.NAMES if name.startswith(("pp_", "moe_", "graph_"))}   # from real PP, MoE, graph code
    assert all("Review notes:" in bugs.describe(name) for name in set(bugs.NAMES) - sp - real)
    assert all("What goes wrong in SP code:" in bugs.describe(name) for name in sp)
    assert all("Where it comes from:" in bugs.describe(name) for name in real)


def test_a_bug_that_replaces_several_parts_describes_them_all():
    several = {name: reps for name, reps in bugs.BUGS.items() if len(reps) > 1}
    assert several                                                    # shard_dim1: qkv_linear and gate_up_linear
    for name, reps in several.items():
        described = bugs.describe(name)
        assert all(r.__name__ in described or r.__doc__.strip().replace("``", "`") in described
                   for r in reps.values()), name
        assert "``" not in described                                  # markdown's code spans, as a notebook prints


@pytest.mark.parametrize("bug", ["mask_mul_inf", "no_rope", "rope_layout"])
def test_attention_and_rope_bugs_diverge_at_the_first_attention(checkpoint, reference, bug):
    rows = bug_rows(checkpoint, reference, [bug])
    assert golden.first_divergence(rows) == "model.layers.0.self_attn"
    assert (rows[2].nonfinite > 0) == (bug == "mask_mul_inf")       # NaN from 0 * -inf; RoPE bugs stay finite


def test_shard_dim1_is_exact_at_tp1_and_wrong_at_tp2(checkpoint, reference):
    assert golden.first_divergence(bug_rows(checkpoint, reference, ["shard_dim1"], tp=1)) is None
    rows = bug_rows(checkpoint, reference, ["shard_dim1"], tp=2)    # loads without an error...
    assert golden.first_divergence(rows) == "model.layers.0.self_attn" and rows[2].nonfinite == 0


def test_kv_cache_repeated_keeps_the_tokens_and_multiplies_the_cache(checkpoint, hf_model):
    folder = checkpoint("untied")                                   # 8 query heads, 2 KV heads
    ref_tokens, _ = hf_greedy(hf_model(folder), PROMPT, GREEDY.max_tokens)
    sizes = {}
    for names in ([], ["kv_cache_repeated"]):
        with LLM(folder, bugs=names, num_kv_blocks=4) as llm:
            assert llm.generate([PROMPT], GREEDY)[0].token_ids == ref_tokens
            sizes[bool(names)] = llm.stats()["kv_cache_bytes"]
    assert sizes[True] == sizes[False] * 8 // 2


def test_decode_position_offby1_is_refused_and_would_change_the_logits(checkpoint, reference):
    with LLM(checkpoint("untied"), bugs=["decode_position_offby1"]) as llm:
        with pytest.raises(ValueError, match=r"has position 6 but 5 tokens are cached before it"):
            llm.generate([PROMPT[:5]], GREEDY)
    hf_last = reference["logits"][-1]
    right, shifted = (bugs.decode_with_positions(checkpoint("untied"), PROMPT, s) for s in (0, 1))
    assert (right - hf_last).abs().max() <= golden.bound(hf_last) < (shifted - hf_last).abs().max() / 100


@pytest.mark.parametrize("name", ["gqa", "untied"])                 # tied and untied checkpoints
def test_lm_head_missing_collapses_the_output_without_an_error(checkpoint, hf_model, name):
    model = load_model(checkpoint(name), bugs=["lm_head_missing"])
    assert not model.lm_head.unloaded.any()                         # the head the forward uses: never loaded
    with LLM(checkpoint(name), bugs=["lm_head_missing"]) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
    assert len(set(out.token_ids)) == 1                             # one token forever
    assert out.token_ids != hf_greedy(hf_model(checkpoint(name)), PROMPT, GREEDY.max_tokens)[0]
    assert out.logprobs == pytest.approx([-math.log(model.config.vocab_size)] * GREEDY.max_tokens)


@pytest.mark.parametrize("model", ["gqa", "tiny_moe"])
def test_full_load_per_rank_reads_the_whole_checkpoint_on_every_rank(model, checkpoint, hf_model):
    """Dense, and an MoE whose ranks hold half the experts each (each expert's tensors by their own names)."""
    folder = checkpoint("gqa") if model == "gqa" else models.tiny_moe()
    full = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    read = {}
    for names in ((), ("full_load_per_rank",)):
        with LLM(folder, tensor_parallel_size=2, enable_expert_parallel=model != "gqa", bugs=names) as llm:
            read[names] = [info["elements_read"] for info in llm.rank_info]
            if names:                                               # ...and the answers are right
                assert llm.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(hf_model(folder), PROMPT, 8)[0]
    assert read[("full_load_per_rank",)] == [full, full] and max(read[()]) < 0.6 * full


def test_bugs_combine(checkpoint, reference):
    names = ["rope_layout", "shard_dim1", "kv_cache_repeated", "full_load_per_rank", "lm_head_missing",
             "decode_position_offby1"]
    mine = golden.tplab_activations(checkpoint("untied"), PROMPT, 1, bugs=names)
    assert golden.first_divergence(golden.compare(reference, mine)) == "model.layers.0.self_attn"  # rope_layout
    assert not mine["logits"].any()                                 # lm_head_missing: a head of zeros


def test_rope_cos_sin_axis_is_silent_only_where_the_local_heads_match_the_tokens(checkpoint):
    folder, ids = checkpoint("vocab_pad"), PROMPT[:2]                # 4 query and 4 KV heads: 2 + 2 per rank at TP 2
    rows = golden.compare(golden.hf_activations(folder, ids),
                          golden.tplab_activations(folder, ids, 2, bugs=["rope_cos_sin_axis"]))
    assert golden.first_divergence(rows) == "model.layers.0.self_attn"  # no error at TP 2, and wrong
    assert all(r.nonfinite == 0 for r in rows)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(4\) must match the size of tensor b \(2\)"):
        golden.tplab_activations(folder, ids, 1, bugs=["rope_cos_sin_axis"])   # 4 heads per rank, 2 tokens
    with pytest.raises(RankError, match="index_copy_"):             # 1 KV head per rank: k grows to (T, T, D)
        golden.tplab_activations(checkpoint("gqa"), ids, 2, bugs=["rope_cos_sin_axis"])


def test_rope_swallowed_runs_without_rope_on_prompts_and_raises_nothing(checkpoint, reference, hf_model):
    folder = checkpoint("untied")                                   # 8 query, 2 KV heads: 4 and 1 per rank at TP 2
    swallowed = golden.tplab_activations(folder, PROMPT, 2, bugs=["rope_swallowed"])
    rows = golden.compare(reference, swallowed)
    assert golden.first_divergence(rows) == "model.layers.0.self_attn" and rows[-1].nonfinite == 0
    no_rope = golden.tplab_activations(folder, PROMPT, 2, bugs=["no_rope"])     # the fallback is no rotation
    assert (swallowed["logits"] - no_rope["logits"]).abs().max() == 0
    with LLM(folder, tensor_parallel_size=2, bugs=["rope_swallowed"]) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids != hf_greedy(hf_model(folder), PROMPT, GREEDY.max_tokens)[0]


def test_qkv_presized_cancels_while_tp_divides_the_kv_heads_and_the_loader_names_the_tensor(checkpoint, hf_model):
    folder = checkpoint("gqa")                                      # 2 KV heads: TP 2 splits them, the sizes cancel
    with LLM(folder, tensor_parallel_size=2, bugs=["qkv_presized"]) as llm:
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == hf_greedy(hf_model(folder), PROMPT, 8)[0]
    with pytest.raises(WeightShapeError, match=r"self_attn\.k_proj\.(weight|bias) in model\.safetensors: "
                                               r"expected shape \(32,( 64)?\), found \(16,( 64)?\)"):
        load_model(checkpoint("mqa"), 2, tp_rank=1, bugs=["qkv_presized"])   # 1 KV head, replicated on 2 ranks


def test_lm_head_random_is_exact_through_the_last_norm_and_wrong_at_the_logits(checkpoint, reference, hf_model):
    folder = checkpoint("untied")
    acts = {tp: golden.tplab_activations(folder, PROMPT, tp, bugs=["lm_head_random"]) for tp in (1, 2)}
    rows = golden.compare(reference, acts[2])
    assert golden.first_divergence(rows) == "logits" and rows[-1].nonfinite == 0
    assert golden.tolerance.within(acts[2]["logits"], acts[1]["logits"])   # the same random head at every TP size
    with LLM(folder, tensor_parallel_size=2, bugs=["lm_head_random"]) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids != hf_greedy(hf_model(folder), PROMPT, GREEDY.max_tokens)[0]


def test_greedy_with_positions_is_hf_at_shift_0_and_off_at_every_decode_step_at_shift_1(checkpoint, hf_model):
    folder = checkpoint("untied")
    ref, _ = hf_greedy(hf_model(folder), PROMPT, 8)
    assert bugs.greedy_with_positions(folder, PROMPT, 8, 0)[0] == ref
    _, right = bugs.greedy_with_positions(folder, PROMPT, 8, 0, follow=ref)
    _, shifted = bugs.greedy_with_positions(folder, PROMPT, 8, 1, follow=ref)
    assert torch.equal(shifted[0], right[0])                        # the first token comes from the prefill
    assert (shifted[1:] - right[1:]).abs().amax(-1).min() > 1e-3    # every decoded step is off


def test_no_mask_with_cache_is_harmless_for_decode_and_wrong_after_a_prefix_cache_hit(checkpoint, hf_model):
    folder = checkpoint("untied")
    prefix = PROMPT[:8]                                             # two full blocks of 4
    prompts = [prefix + [11, 12], prefix + [13, 14, 15, 16, 17]]    # the second hits the first's blocks
    want = [hf_greedy(hf_model(folder), p, GREEDY.max_tokens) for p in prompts]
    runs = {}
    for caching in (False, True):
        with LLM(folder, tensor_parallel_size=2, bugs=["no_mask_with_cache"], block_size=4, max_num_seqs=1,
                 enable_prefix_caching=caching) as llm:
            runs[caching] = llm.generate(prompts, GREEDY), llm.stats()["prefix_cache_hit_blocks"]
    (outs, hits), (cached, cached_hits) = runs[False], runs[True]
    assert hits == 0 and [o.token_ids for o in outs] == [t for t, _ in want]     # one-token decode steps: exact
    assert all(abs(a - b) <= w.bound for o, w in zip(outs, want) for a, b in zip(o.logprobs, w[1]))
    assert cached_hits == 2 and cached[0].token_ids == want[0][0]               # the first request: no hit
    assert max(abs(a - b) for a, b in zip(cached[1].logprobs, want[1][1])) > 1e-2  # the hit: 5 new tokens unmasked
