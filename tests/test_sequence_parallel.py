"""Sequence parallelism (``LLM(..., sequence_parallel=True)``): each row-parallel all-reduce becomes a
reduce-scatter over tokens, the residual stream and the norms hold each rank's T / t tokens, and an
all-gather brings the tokens back before each column-parallel layer and the LM head. Greedy tokens equal
HF's and logprobs stay within the fp32 bound at TP 2 and 4, with chunked prefill, prefix caching and
preemption on; a decode step's collectives and bytes are the ones derived by hand below."""
import pytest
import torch

from conftest import CONFIGS, hf_greedy
from tplab import LLM, SamplingParams, launch
from tplab import golden

# lengths 5, 2, 31, 9 and 7: odd lengths and chunks (max_num_batched_tokens=11) that t does not divide
PROMPTS = [[3, 17, 42, 99, 5], [250, 7], list(range(40, 71)), [11] * 9, [3, 17, 42, 99, 5, 8, 1]]
MAX_TOKENS = 10


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sequence_parallel_matches_hf(name, tp, checkpoint, hf_model):
    model = hf_model(checkpoint(name))
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    # 11 tokens a step: prompts are prefilled in chunks beside running decodes; 16 blocks of 4 tokens for
    # 5 sequences that end with 28 blocks' worth (up to 41 tokens each): preemption; prompts 0 and 4 share a
    # first block: a prefix-cache hit
    with LLM(checkpoint(name), tensor_parallel_size=tp, sequence_parallel=True, max_num_batched_tokens=11,
             block_size=4, num_kv_blocks=16, enable_prefix_caching=True) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        stats = llm.stats()
    assert len(outs) == len(refs) == len(PROMPTS)
    for prompt, out, ref in zip(PROMPTS, outs, refs):
        assert out.token_ids == ref[0], f"{name} tp{tp} SP: tokens differ from HF for prompt {prompt[:5]}..."
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref[1]))
        assert worst <= ref.bound, f"{name} tp{tp} SP: logprob off by {worst:.2e}, bound {ref.bound:.2e}"
    assert stats["prefix_cache_hit_blocks"] > 0 and stats["num_preemptions"] > 0, stats


def _step_collectives(model, sequence_parallel):
    from tplab.distributed.parallel_state import count_collectives

    with LLM(model, tensor_parallel_size=2, num_kv_blocks=8, sequence_parallel=sequence_parallel) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2)]
        with count_collectives() as prefill:
            first = llm.generate([[1, 2, 3, 4, 5, 6]], params[0])[0].token_ids
        with count_collectives() as both:
            tokens = llm.generate([[1, 2, 3, 4, 5, 6]], params[1])[0].token_ids
    decode = both[len(prefill):]
    return ([(r.op, r.shape, r.nbytes) for r in prefill], [(r.op, r.shape, r.nbytes) for r in decode],
            first, tokens)


def _expected(layers: int, hidden: int, per_rank_vocab: int, tokens: int, tp: int = 2):
    """By hand: the embedding's partial lookups reduce-scattered (T padded to a multiple of t), per
    layer an all-gather of this rank's ceil(T / t) tokens before qkv_proj and gate_up_proj and a
    reduce-scatter of the T tokens padded to a multiple of t after o_proj and down_proj, one all-gather
    before the LM head, and the LM head's all-gather of this rank's vocabulary rows. fp32: 4 bytes."""
    local = -(-tokens // tp)
    layer = [("all_gather", (local, hidden), 4 * local * hidden),
             ("reduce_scatter", (tp * local, hidden), 4 * tp * local * hidden)] * 2
    scatter = [("reduce_scatter", (tp * local, hidden), 4 * tp * local * hidden)]
    return (scatter + layer * layers
            + [("all_gather", (local, hidden), 4 * local * hidden),
               ("all_gather", (1, per_rank_vocab), 4 * per_rank_vocab)])


def test_decode_step_at_tp2_reduce_scatters_and_all_gathers_instead_of_all_reducing(checkpoint):
    """The collectives of a 6-token prefill and of one decode step at TP 2, with SP and without."""
    from transformers import AutoConfig
    path = checkpoint("vocab_pad")                                   # vocab 251: the LM head's shard is padded
    cfg = AutoConfig.from_pretrained(path)
    layers, hidden, per_rank = cfg.num_hidden_layers, cfg.hidden_size, -(-cfg.vocab_size // 2)
    sp = launch(_step_collectives, 2, args=(str(path), True), timeout=300)
    plain = launch(_step_collectives, 2, args=(str(path), False), timeout=300)
    for (prefill, decode, first, tokens), (plain_prefill, plain_decode, _, plain_tokens) in zip(sp, plain):
        assert tokens == plain_tokens and tokens[:1] == first
        assert decode == _expected(layers, hidden, per_rank, tokens=1)   # one decode token, padded to 2
        assert prefill == _expected(layers, hidden, per_rank, tokens=6)  # 6 prompt tokens: 3 per rank
        assert [op for op, _, _ in plain_decode].count("all_reduce") == 2 * layers + 1
        # Bytes each rank puts in: a 6-token prefill's reduce-scatters carry what its all-reduces carried,
        # and its all-gathers half of it (in a ring each moves (t-1)/t of its full tensor: the same as
        # an all-reduce's 2 (t-1)/t between the two). A lone decode token is padded to 2 rows, so
        # its reduce-scatters put in twice the all-reduce's bytes: SP pays off from T >= t tokens.
        rs = lambda records: sum(n for op, _, n in records if op == "reduce_scatter")
        ar = lambda records: sum(n for op, _, n in records if op == "all_reduce")
        assert rs(prefill) == ar(plain_prefill) == (2 * layers + 1) * 6 * hidden * 4
        assert rs(decode) == 2 * ar(plain_decode) == (2 * layers + 1) * 2 * hidden * 4
        assert ar(prefill) == ar(decode) == 0                        # no all-reduce at all under SP


def _generate_and_paths(model, parts=None):
    from tplab.distributed.parallel_state import count_collectives

    with LLM(model, tensor_parallel_size=2, sequence_parallel=True, max_num_batched_tokens=7, parts=parts) as llm:
        with count_collectives() as seen:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs], {(r.op, r.path) for r in seen}


def test_an_embedding_that_only_all_reduces_is_sliced_by_each_rank(checkpoint, hf_model):
    """A learner's embedding (notebook 06's solution) does not say it returns partial lookups: it keeps its
    all-reduce, each rank keeps its own tokens of it, and the tokens are still HF's."""
    from tplab.exercises.solutions.embedding import MyVocabParallelEmbedding
    model = hf_model(checkpoint("vocab_pad"))
    want = [hf_greedy(model, p, MAX_TOKENS)[0] for p in PROMPTS]
    parts = {"embedding": MyVocabParallelEmbedding}
    for tokens, paths in launch(_generate_and_paths, 2, args=(str(checkpoint("vocab_pad")), parts), timeout=300):
        assert tokens == want and {op for op, _ in paths} == {"all_reduce", "reduce_scatter", "all_gather"}


def test_sequence_parallel_through_the_process_group_matches_hf(checkpoint, hf_model, monkeypatch):
    """With shared memory off, the reduce-scatters and all-gathers go through gloo itself."""
    monkeypatch.setenv("TPLAB_SHM_COMM", "0")                       # the ranks take this environment
    model = hf_model(checkpoint("mqa"))
    want = [hf_greedy(model, p, MAX_TOKENS)[0] for p in PROMPTS]
    for tokens, paths in launch(_generate_and_paths, 2, args=(str(checkpoint("mqa")),), timeout=300):
        assert tokens == want
        assert {"reduce_scatter", "all_gather"} <= {op for op, _ in paths} and {p for _, p in paths} == {"gloo"}


def _reduce_scatter_both_paths():
    import torch.distributed as dist
    from tplab.distributed import parallel_state as ps

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6 * 3, dtype=torch.float32).view(6, 3) * (rank + 1)  # ranks hold x0, 2 x0
    shm = ps.reduce_scatter(x.clone(), n, dim=0)
    group = ps._reduce_scatter(x.clone(), None, None, n, 0)         # the process group's path
    try:
        ps.reduce_scatter(torch.ones(5, 3), n, dim=0)
        error = ""
    except ValueError as e:
        error = str(e)
    return rank, shm, group, ps._shm_for(x) is not None, error


def test_reduce_scatter_sums_and_keeps_this_ranks_rows_through_shared_memory_and_gloo():
    for rank, shm, group, used_shm, error in launch(_reduce_scatter_both_paths, 2, timeout=120):
        want = (torch.arange(18, dtype=torch.float32).view(6, 3) * 3)[3 * rank:3 * rank + 3]
        assert used_shm and torch.equal(shm, want) and torch.equal(group, want)
        assert "not divisible by tp_size 2" in error and "pad" in error


class UnmarkedRowLinear(torch.nn.Module):
    """A learner's row_linear that does not say it can return partial sums (refused before it is built)."""


def test_sequence_parallel_refuses_a_row_linear_that_cannot_return_partial_sums(checkpoint):
    with pytest.raises(ValueError, match="ReturnsPartialSums.*UnmarkedRowLinear"):
        LLM(checkpoint("gqa"), tensor_parallel_size=2, sequence_parallel=True,
            parts={"row_linear": UnmarkedRowLinear})
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        LLM(checkpoint("gqa"), tensor_parallel_size=2, sequence_parallel="yes")


def test_sequence_parallel_at_tp1_is_the_plain_model(checkpoint, hf_model):
    prompt = PROMPTS[0]
    with LLM(checkpoint("gqa"), sequence_parallel=True) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.token_ids == hf_greedy(hf_model(checkpoint("gqa")), prompt, 4)[0]


# Under SP a rank's hooks see: its own tokens of the residual stream and norms (rows
# [r * ceil(T/t), (r+1) * ceil(T/t)) of the padded tokens), the partial sums of o_proj/down_proj
# and the embedding's partial lookups (self_attn, mlp, embed_tokens: summed over ranks they are HF's), and
# the full logits.
ROWS_OF_THIS_RANK = ("input_layernorm", "post_attention_layernorm", "model.norm")


def _sp_activations(model_dir, input_ids, tp):
    from tplab.engine.probe import load_model, probe

    model = load_model(model_dir, tp, sequence_parallel=True)
    names = golden.activation_names(len(model.model.layers))[:-1]
    out = probe(model, input_ids, outputs_of=names)
    return {**out.outputs, "logits": out.logits.float()}


def _combine(per_rank: list[dict], name: str, num_tokens: int) -> torch.Tensor:
    if name.endswith(ROWS_OF_THIS_RANK) or name.split(".")[-1].isdigit():   # a norm or a layer's output
        return torch.cat([acts[name] for acts in per_rank])[:num_tokens]      # drop the padding rows
    if name.endswith(("self_attn", "mlp", "embed_tokens")):
        return sum(acts[name] for acts in per_rank[1:]) + per_rank[0][name]   # rank order, as the reduction
    return per_rank[0][name]


@pytest.mark.parametrize("name,tp", [("gqa", 2), ("untied", 4)])
def test_every_sublayer_under_sequence_parallel_matches_hf(name, tp, checkpoint, hf_model):
    ids = list(range(3, 20))                                         # 17 tokens: padded to 18 or 20
    ref = golden.hf_activations(hf_model(checkpoint(name)), ids)
    per_rank = launch(_sp_activations, tp, args=(str(checkpoint(name)), ids, tp), timeout=300)
    assert per_rank[0]["model.layers.0"].shape[0] == -(-len(ids) // tp)   # each rank holds T / t tokens
    mine = {n: _combine(per_rank, n, len(ids)) for n in ref}
    rows = golden.compare(ref, mine)
    assert golden.first_divergence(rows) is None, golden.report(rows)


def test_bf16_and_the_finite_check_give_plain_tps_tokens_on_the_shipped_model():
    """bf16 rounds every stored activation; SP sums the same partial sums in the same order (shared
    memory adds rank 0's then rank 1's) and runs the same per-token norms, so its tokens are plain TP's."""
    from tplab import models
    prompts = ["Once upon a time", "The little dog"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for sp in (False, True):
        with LLM(models.tiny_stories(), tensor_parallel_size=2, dtype="bfloat16", check_finite=True,
                 sequence_parallel=sp) as llm:
            tokens[sp] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens[True] == tokens[False]


def _region_results(tp: int, add=None) -> list:
    """What ``sp_region_probe.run`` returns on each rank for the right region; ``add(summed, residual, rank)``, when
    given, is add(partial, residual)'s output instead."""
    from tplab.exercises.sp_region_probe import CountingNorm, E, TOKENS, inputs, rows
    results = [[] for _ in range(tp)]
    for n in TOKENS:
        partials, residual, weight = inputs(n, tp)
        per_rank = -(-n // tp)
        ops = {"local": [], "add_first": [("reduce_scatter", tp * per_rank * E * 4)],
               "add": [("reduce_scatter", tp * per_rank * E * 4)], "norm_gather": [("all_gather", per_rank * E * 4)]}
        for rank in range(tp):
            summed, mine = rows(partials.sum(0), rank, tp), rows(residual, rank, tp)
            results[rank].append({"local": mine, "add_first": summed, "norm_rows": per_rank, "ops": ops,
                                  "add": summed + mine if add is None else add(summed, residual, rank),
                                  "norm_gather": CountingNorm(weight)(residual).detach()})
    return results


def test_the_region_check_blames_the_residual_when_only_the_residual_is_wrong():
    """add(partial) right, add(partial, residual) wrong: the message names the residual's mistake, not the sum."""
    from tplab.exercises.sp_region_probe import diagnose, rows
    assert diagnose(_region_results(2), 2)[0] is True
    for add, words in [(lambda s, r, rank: s + 2 * rows(r, rank, 2), "the residual was added 2 times, once per rank"),
                       (lambda s, r, rank: s + rows(r, 1 - rank, 2), "it added rank 1's rows of the residual"),
                       (lambda s, r, rank: s + rows(r, rank, 2) / 2, "add(partial) is right, so the residual is off")]:
        ok, why = diagnose(_region_results(2, add), 2)
        assert ok is False and words in why and "sum over the ranks" not in why, why


def test_the_region_check_names_a_missing_return_and_a_gather_of_the_wrong_shape():
    from tplab.exercises.sp_region_probe import diagnose
    results = _region_results(2)
    results[1][0]["local"] = None
    ok, why = diagnose(results, 2)
    assert ok is False and "rank 1, T = 5 at TP 2: local(full) returned None: did you forget `return`?" in why, why
    results = _region_results(2)
    results[0][0]["norm_gather"] = results[0][0]["norm_gather"][1:4]          # 3 of the 5 tokens, not its own
    ok, why = diagnose(results, 2)
    assert ok is False and "norm_gather returned shape (3, 8): return the (T, E) = (5, 8) normed tokens" in why, why
    results = _region_results(2)
    results[0][0]["norm_gather"] = results[0][0]["norm_gather"][:3]            # rank 0's own 3 rows: not gathered
    ok, why = diagnose(results, 2)
    assert ok is False and "norm_gather returned this rank's 3 normed rows, not gathered" in why, why
