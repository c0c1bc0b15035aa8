"""Data-parallel attention with the experts spread over every rank (``data_parallel_size``, ``enable_expert_parallel``),
against HF's own MoE models: greedy tokens equal HF's and logprobs are within the fp32 bound at DP 2 x EP and
DP 2 x TP 2 x EP, with chunked prefill, prefix-cache hits and preemption on every DP rank in the same run, over
shared memory and over gloo, and composed with pipeline parallelism (DP 2 x PP 2, x TP 2); the answers come back in prompt order; a DP rank with no prompt joins every
exchange and nothing hangs; a dense model's DP ranks are replicas; the sizes are checked before any rank starts; a
learner's dispatch whose per-expert counts differ in width between ranks is named (torch.bincount's minlength)."""
import sys

import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, models
from tplab.distributed.launcher import launch
from tplab.engine.data_parallel import in_prompt_order, split_prompts

MAX_TOKENS = 8
SHARED, OTHER = list(range(60, 100)), list(range(150, 190))          # two 40-token prefixes
PROMPTS = [list(range(1, 70)), SHARED + [1, 2, 3], [3, 17, 42], SHARED + [4], [250, 7] * 20, OTHER + [5], [9],
           OTHER + [6, 8]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# 14 blocks of 8 tokens on each DP rank for its 4 prompts, 16 tokens a step: chunks, prefix hits, preemption on both
TIGHT = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True)
MODELS = {
    "qwen2_moe": lambda d: models.save_random_qwen2_moe(d, seed=1, num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen3_moe": lambda d: models.save_random_qwen3_moe(d, seed=2),
}
DP_EP = dict(data_parallel_size=2, enable_expert_parallel=True)


@pytest.fixture(scope="module")
def reference(hf_model, moe):
    cache = {}

    def ref(name, prompts=tuple(map(tuple, PROMPTS))):
        if (name, prompts) not in cache:
            cache[name, prompts] = [hf_greedy(hf_model(moe(name)), list(p), MAX_TOKENS) for p in prompts]
        return cache[name, prompts]
    return ref


def assert_matches_hf(outs, reference, prompts, what):
    """``outs``: ``RequestOutput``s, or ``(prompt ids, token ids, logprobs)`` triples."""
    answers = [(o.prompt_token_ids, o.token_ids, o.logprobs) if hasattr(o, "token_ids") else o for o in outs]
    assert [a[0] for a in answers] == [list(p) for p in prompts], f"{what}: answers out of prompt order"
    for (prompt, tokens, logprobs), ref in zip(answers, reference):
        assert tokens == ref[0], f"{what}: tokens differ from HF for a prompt of {len(prompt)} tokens"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref[1]))
        assert worst <= ref.bound, f"{what}: logprob off by {worst:.2e}, bound {ref.bound:.2e}"


RUNS = {"dp2-ep": dict(DP_EP), "dp2-tp2-ep": dict(DP_EP, tensor_parallel_size=2), "dp2-ep-gloo": dict(DP_EP)}


def _generate_counted(folder: str, settings: dict):
    """In each of 2 ranks (torchrun's way: the LLM in every rank): the answers and stats of PROMPTS, and the paths
    this rank's all-to-alls took."""
    from tplab.distributed.parallel_state import count_collectives
    with LLM(folder, **settings) as llm:
        with count_collectives() as seen:
            outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    swaps = [r.path for r in seen if r.op == "all_to_all"]
    return [(o.prompt_token_ids, o.token_ids, o.logprobs) for o in outs], stats, len(swaps), set(swaps)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_hf_with_chunks_prefix_hits_and_preemption_on_every_dp_rank(name, run, moe, reference,
                                                                                    monkeypatch):
    if run.endswith("gloo"):
        monkeypatch.setenv("TPLAB_SHM_COMM", "0")          # every collective through the process group: gloo's all_to_all
        ranks = launch(_generate_counted, 2, args=(str(moe(name)), dict(RUNS[run], **TIGHT)), timeout=300)
        for _, _, swaps, paths in ranks:                   # the experts' exchanges went through gloo, on both ranks
            assert swaps > 0 and paths == {"gloo"}, (swaps, paths)
        outs, stats, _, _ = ranks[0]
    else:
        with LLM(moe(name), **RUNS[run], **TIGHT) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
            stats = llm.stats()
    assert_matches_hf(outs, reference(name), PROMPTS, f"{name} {run}")
    assert len({t for tokens, _ in reference(name) for t in tokens}) >= 8, "HF's own output is too weak a reference"
    for rank in stats["dp_ranks"]:                         # each DP rank served its share, under pressure
        assert rank["num_preemptions"] > 0 and rank["prefix_cache_hit_blocks"] > 0 and rank["kv_blocks_in_use"] == 0
    assert len(stats["dp_ranks"]) == 2 and all(r["num_steps"] > 0 for r in stats["dp_ranks"])


def _one_prompt_counted(folder: str, prompt: list[int]):
    """In each of 2 ranks (torchrun's way: the LLM in every rank): one prompt, so DP rank 1 has none."""
    from tplab.distributed.parallel_state import count_collectives
    with LLM(folder, **DP_EP) as llm, count_collectives() as seen:
        out = llm.generate([prompt], GREEDY)[0]
    swaps = [r for r in seen if r.op == "all_to_all"]
    return out.token_ids, out.logprobs, len(swaps), [r.shape[0] for r in swaps[::2]], {r.path for r in swaps}


def test_a_dp_rank_with_no_prompt_joins_every_exchange_and_nothing_hangs(moe, reference):
    folder, prompt = moe("qwen2_moe"), PROMPTS[0]
    with LLM(folder, timeout=120, **DP_EP) as llm:          # through the driver: one prompt, DP rank 1 idle
        assert_matches_hf(llm.generate([prompt], GREEDY), reference("qwen2_moe", (tuple(prompt),)), [prompt], "dp2")
    busy, idle = launch(_one_prompt_counted, 2, args=(str(folder), prompt), timeout=120)
    assert busy[:2] == idle[:2]                              # every rank returns every answer
    assert_matches_hf([(prompt, busy[0], busy[1])], reference("qwen2_moe", (tuple(prompt),)), [prompt], "under torchrun")
    moe_layers, steps = 2, 1 + MAX_TOKENS - 1                # layers 0 and 2; one prefill step, then the decodes
    assert busy[2] == idle[2] == 2 * moe_layers * steps, "a DP rank skipped an exchange"
    assert set(busy[3]) == {len(prompt) * 2, 2} and set(idle[3]) == {0}   # k = 2 rows a token; the idle one sends none
    assert busy[4] == idle[4] == {"shm"}


def test_the_split_is_by_load_deterministic_and_answers_return_in_prompt_order():
    assert split_prompts([100, 10, 10, 10, 100, 50], 2) == [[0, 5], [1, 2, 3, 4]]   # the least loaded rank
    assert split_prompts([5], 2) == [[0], []]               # a DP rank may get nothing
    assert split_prompts([3, 3, 3, 3], 2) == [[0, 2], [1, 3]]   # ties: the lowest rank
    shares = split_prompts([7, 1, 1, 9, 2], 3)
    answers = [[f"p{i}" for i in share] for share in shares]
    assert in_prompt_order(answers, shares) == ["p0", "p1", "p2", "p3", "p4"]
    with pytest.raises(RuntimeError, match="a DP rank answered 1 of its 2 prompts"):
        in_prompt_order([["a"], ["b"]], [[0, 2], [1]])


def test_a_dense_model_runs_data_parallel_replicas(checkpoint):
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [40] * 12, [3]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(checkpoint("gqa")) as one:
        want = [(o.token_ids, o.logprobs) for o in one.generate(prompts, params)]
    with LLM(checkpoint("gqa"), data_parallel_size=2) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == [w[0] for w in want]
    assert max(abs(a - b) for o, w in zip(outs, want) for a, b in zip(o.logprobs, w[1])) < 1e-5
    assert [r["num_steps"] > 0 for r in stats["dp_ranks"]] == [True, True]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallelism_composes_with_pipeline_parallelism(name, tp, moe, reference):
    """DP 2 x PP 2 (x TP 2) x EP: each DP rank a pipeline of two stages, each stage's experts spread over that stage's
    ranks in both DP ranks; a stage with no batch in a tick joins its MoE layers' exchanges all the same."""
    settings = dict(DP_EP, pipeline_parallel_size=2, tensor_parallel_size=tp, **dict(TIGHT, num_kv_blocks=20))
    with LLM(moe(name), **settings) as llm:                # 10 blocks for each batch in flight
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert_matches_hf(outs, reference(name), PROMPTS, f"{name} DP 2 x PP 2 x TP {tp}")
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0, stats
    assert all(rank["num_steps"] > 0 and rank["kv_blocks_in_use"] == 0 for rank in stats["dp_ranks"]), stats


def test_the_sizes_are_checked_before_any_rank_starts(tmp_path, checkpoint, no_new_children):
    six = models.save_random_qwen3_moe(tmp_path / "six", num_experts=6)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4 ranks share the experts "
                       r"whole, and the 6 experts \(num_experts\) do not divide by 4: with tensor_parallel_size=2 use "
                       r"data_parallel_size in \[1, 3\]"):
        LLM(six, tensor_parallel_size=2, **DP_EP)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 on an MoE model \(6 experts\) spreads the experts over "
                       r"all 2 x 1 = 2 ranks, which tplab does by expert parallelism only: pass enable_expert_parallel=True"):
        LLM(six, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"sequence_parallel=True with data_parallel_size=3"):
        LLM(six, tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=3, enable_expert_parallel=True)
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match=r"data_parallel_size must be an int >= 1"):
            LLM(checkpoint("gqa"), data_parallel_size=bad)


def counts_without_minlength(x, ids, num_experts, ep_rank, ep_size):
    """The reference dispatch counting with torch.bincount(ids.flatten()): only as long as the rank's largest id + 1."""
    from tplab.distributed.parallel_state import all_to_all, ep_all_gather
    per_rank, order = num_experts // ep_size, ids.flatten().argsort(stable=True)
    plan = ep_all_gather(torch.bincount(ids.flatten()), ep_size).view(ep_size, ep_size, per_rank)
    local = torch.arange(per_rank).repeat(ep_size).repeat_interleave(plan[:, ep_rank].flatten())
    return all_to_all(x[order // ids.shape[1]], plan.sum(-1).tolist()), local, order, plan.sum(-1).tolist()


def test_a_dispatch_whose_counts_skip_the_experts_no_token_chose_is_named():
    import cloudpickle

    from tplab.exercises import check_part, in_engine
    cloudpickle.register_pickle_by_value(sys.modules[__name__])       # the dispatch travels to the ranks by value
    try:
        result = check_part("moe_dispatch", counts_without_minlength)
    finally:
        in_engine.close_kept_ranks()
    assert result.ok is False and "all_gather have different widths: [[8], [7]] (rank by rank): one entry per " \
        "expert (8) on one rank, fewer on another" in result.message, result.message
    assert "torch.bincount(ids.flatten(), minlength=num_experts)" in result.message, result.message
