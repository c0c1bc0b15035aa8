"""The pitfalls of a student's TP implementation, each a drop-in replacement for one part of the engine.

``LLM(..., bugs=["mask_mul_inf"])`` builds the engine with these parts swapped in; the engine itself has no
``if bug:`` branches. Each replacement's docstring says where its pitfall comes from: the review notes it
quotes, or the real SP, PP, MoE or CUDA-graph code it stands for. A bug replaces fields of ``tplab.Parts``
(``tplab.engine.parts.FIELDS``); bugs that replace different fields combine. ``tplab.engine.parts``, the one
place where parts are resolved, finds them by name in ``BUGS``, handed to it by ``tplab/__init__.py``. By area:
``attention``, ``rope``, ``sharding``, ``positions``, ``loading``, ``sequence_parallel`` and ``pipeline``
(notebook 07's: pitfalls of real SP and PP code rather than of the review notes), ``moe`` (notebook 08's:
experts spread over ranks), ``graphs`` (a CUDA graph's replay reading stale inputs).
"""
from tplab.bugs.attention import RepeatedKVAttention, mask_mul_inf_attend, no_mask_with_cache_attend
from tplab.bugs.graphs import StaleInputsDecode
from tplab.bugs.loading import RandomLMHead, UnloadedLMHead, full_load_per_rank_load
from tplab.bugs.moe import GlobalIdsMoE, NotRenormalizedMoE, SharedExpertEveryRankLinear
from tplab.bugs.pipeline import KVEveryLayerStage, ResidualNotSentStage
from tplab.bugs.positions import decode_with_positions, greedy_with_positions, offby1_token_positions
from tplab.bugs.sequence_parallel import HiddenScatterNormRegion, NormTwiceNormRegion
from tplab.bugs.rope import no_rope_apply, rope_cos_sin_axis_apply, rope_layout_apply, rope_swallowed_apply
from tplab.bugs.sharding import Dim1MergedColumnParallelLinear, Dim1QKVParallelLinear, PresizedQKVParallelLinear

# name -> {field of tplab.Parts: replacement}: the catalogue tplab.engine.parts looks names up in
BUGS = {
    # attention: the causal mask, what the cache holds (notebooks 01, 04, 05)
    "mask_mul_inf": {"attend": mask_mul_inf_attend},
    "no_mask_with_cache": {"attend": no_mask_with_cache_attend},
    "kv_cache_repeated": {"attention": RepeatedKVAttention},
    # RoPE and positions (notebooks 03, 04)
    "no_rope": {"apply_rope": no_rope_apply},
    "rope_layout": {"apply_rope": rope_layout_apply},
    "rope_cos_sin_axis": {"apply_rope": rope_cos_sin_axis_apply},
    "rope_swallowed": {"apply_rope": rope_swallowed_apply},
    "decode_position_offby1": {"positions": offby1_token_positions},
    # sharding (notebook 02)
    "shard_dim1": {"qkv_linear": Dim1QKVParallelLinear, "gate_up_linear": Dim1MergedColumnParallelLinear},
    "qkv_presized": {"qkv_linear": PresizedQKVParallelLinear},
    # loading and the LM head (notebook 06)
    "lm_head_missing": {"lm_head": UnloadedLMHead},
    "lm_head_random": {"lm_head": RandomLMHead},
    "full_load_per_rank": {"load_weights": full_load_per_rank_load},
    # sequence parallelism (notebook 07; with LLM(..., sequence_parallel=True)): not from the review notes
    "sp_scatter_hidden": {"sp_norm_region": HiddenScatterNormRegion},
    "sp_norm_twice": {"sp_norm_region": NormTwiceNormRegion},
    # pipeline parallelism (notebook 07; LLM(..., pipeline_parallel_size > 1)): the boundary, a stage's KV cache
    "pp_residual_not_sent": {"pipeline_stage": ResidualNotSentStage},
    "pp_kv_every_layer": {"pipeline_stage": KVEveryLayerStage},
    # mixture of experts (notebook 08): the router's weights, local vs global expert ids, the shared expert's sum
    "moe_not_renormalized": {"experts": NotRenormalizedMoE},
    "moe_global_ids": {"experts": GlobalIdsMoE},
    "moe_shared_expert_every_rank": {"row_linear": SharedExpertEveryRankLinear},
    # decode steps at fixed shapes, replayed as CUDA graphs (notebook 06; with LLM(..., static_decode=True) on CPU)
    "graph_stale_inputs": {"static_decode": StaleInputsDecode},
}
NAMES = tuple(BUGS)


def describe(name: str) -> str:
    """The pitfall a bug reproduces (its replacement's docstring, its code spans in single backticks, as a
    notebook's markdown has them)."""
    if name not in BUGS:
        raise ValueError(f"unknown bug name {name!r}; known: {list(NAMES)}")
    return next(iter(BUGS[name].values())).__doc__.strip().replace("``", "`")


__all__ = ["NAMES", "describe", "decode_with_positions", "greedy_with_positions", *(
    r.__name__ for reps in BUGS.values() for r in reps.values())]
