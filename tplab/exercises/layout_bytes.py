"""The bytes each layout of an MoE model puts into collectives, per prefill and per decode step: counted in a real
run (``count_layout_bytes``) and from the formula (``expected_bytes``), so that a notebook can price them on a link.

Layouts, with vLLM's settings: TP inside each expert (``tensor_parallel_size=t``), EP (``enable_expert_parallel``:
the same collectives, whole experts per rank), and DP x EP (``data_parallel_size=d``: attention data-parallel, the
experts over all ``d t`` ranks, tokens exchanged by all-to-all). Per forward of T tokens on a DP rank, TP rank r:
    all_reduce   (1 + 2 L) T E b            the embedding, and each layer's attention and MLP/MoE block (t > 1)
    all_gather   S ceil(V / t) b            the LM head's logits of the S sampled rows (t > 1);
                 + M X 8                    under DP: each MoE layer's expert counts (int64), each forward
    all_to_all   M T_r k E b                under DP: dispatch, T_r = this TP rank's share of the T tokens;
                 + M R E b                  and combine, R the rows it received (on average T_r k: every pair
                                            goes to one rank, its own a share 1 / (d t) of the time)
    dp_any       8 per step                 under DP: the DP ranks' check whether any has work
(E hidden size, L layers of which M are MoE layers, X experts, k per token, V vocabulary, b bytes per element.)
"""
from tplab.distributed.launcher import launch
from tplab.distributed.parallel_state import cdiv
from tplab.engine.config import engine_config
from tplab.models.qwen_moe import is_moe_layer
from tplab.models.registry import has_experts


def expected_bytes(config, tokens: int, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                   dtype_bytes: int = 4, sampled: int = 1, forwards: int = 1) -> dict[str, int]:
    """What TP rank 0 of a DP rank puts into collectives for ``tokens`` tokens on its DP rank run in ``forwards``
    forward passes (a prompt's chunks; 1: a decode step), by op (``CollectiveRecord.op``), from the formula above
    (``all_to_all``: dispatch, and combine at its expectation); ``sampled`` rows go through the LM head.
    ``config``: the checkpoint's HF config (``EngineConfig.hf_config``). The DP ranks' step checks are not in it."""
    t, d, b, hidden = tensor_parallel_size, data_parallel_size, dtype_bytes, config.hidden_size
    layers = config.num_hidden_layers
    moe = sum(is_moe_layer(config, i) for i in range(layers)) if has_experts(config) else 0
    out = {}
    if t > 1:
        out["all_reduce"] = (1 + 2 * layers) * tokens * hidden * b
        if sampled:
            out["all_gather"] = sampled * cdiv(config.vocab_size, t) * b
    if d > 1 and moe:
        out["all_gather"] = out.get("all_gather", 0) + forwards * moe * config.num_experts * 8
        out["all_to_all"] = 2 * moe * cdiv(tokens, t) * config.num_experts_per_tok * hidden * b
    return out


def count_layout_bytes(model, prompt_tokens: int = 2048, **settings) -> list[dict]:
    """Count, in a real run of ``LLM(model, **settings)`` in launched ranks, the bytes every rank puts into
    collectives (``parallel_state.count_collectives``) while each DP rank prefills one prompt of
    ``prompt_tokens`` tokens (in chunks of ``max_num_batched_tokens``), and in the one decode step after it.
    One dict per rank, in rank order: ``{"prefill": {op: bytes}, "decode": {op: bytes}}``, with
    ``"all_to_all_to_others"`` beside ``"all_to_all"`` (the bytes of the rows for other ranks) and
    ``"dp_any"`` (the DP ranks' step checks: one a step, and one more when the prefill ends)."""
    cfg = engine_config(model, **settings)
    return launch(_count_in_rank, cfg.world_size, args=(str(model), prompt_tokens, settings), timeout=cfg.timeout)


def _count_in_rank(model: str, prompt_tokens: int, settings: dict) -> dict:
    """In one rank: the prefill's records, then those of a prefill and one decode step, told apart."""
    from tplab.distributed.parallel_state import count_collectives
    from tplab.engine.llm import LLM
    from tplab.engine.sampling import SamplingParams

    with LLM(model, **settings) as llm:
        dp, vocab = llm.config.data_parallel_size, llm.config.hf_config.vocab_size
        prompts = [[(7919 * i + 104729 * r) % (vocab - 1) + 1 for i in range(prompt_tokens)] for r in range(dp)]
        with count_collectives() as prefill:           # one prompt per DP rank; the first token sampled
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        with count_collectives() as both:              # the same prefill again (no prefix cache), one decode step
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    first, total = tally(prefill), tally(both)
    return {"prefill": first, "decode": {op: total[op] - first.get(op, 0) for op in total}}


def tally(records) -> dict[str, int]:
    """Bytes put in, by op, of a list of ``CollectiveRecord``s; and ``all_to_all_to_others``."""
    out: dict[str, int] = {}
    for r in records:
        out[r.op] = out.get(r.op, 0) + r.nbytes
        if r.to_others is not None:
            out["all_to_all_to_others"] = out.get("all_to_all_to_others", 0) + r.to_others
    return out
