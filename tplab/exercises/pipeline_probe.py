"""``check_part("pipeline_stage", ...)``: a learner's pipeline stage, judged in three steps.

1. Alone, in this process: which layers each stage owns, for several (layers, stages) (the split's mistake
   named: the remainder dropped, each range one layer short, a gap, an overlap), whether the first stage embeds
   and the last holds the head, and which layers it keeps a KV cache for.
2. The boundary, in real ranks (t x 2, ``boundary_probe``): two known pairs, each TP rank's to its peer, every
   send and recv watched, so a blocking send, a dropped request, a wrong peer or a buffer of another size is
   named at once instead of hanging (or aborting) the engine.
3. Inside the engine at (t, 2) on the shipped model: every sublayer, each from the stage that owns it,
   against HF (``golden.stage_activations``), then greedy tokens against HF's.
"""
import uuid

import cloudpickle

from tplab.engine.sampling import SamplingParams
from tplab.exercises import ExerciseResult, boundary_probe
from tplab.exercises.in_engine import (NEW_TOKENS, engine_config, first_diff, kept_ranks, reference, serve_here,
                                       worst_share)
from tplab.exercises.watchdog import DidNotReturn, bound_for, call_bounded
from tplab.golden import stage_activations

CASES = [(4, 2), (4, 4), (5, 2), (5, 4), (3, 2), (28, 4), (24, 8)]     # (layers, stages)
PP = boundary_probe.PP                                                 # the stages of steps 2 and 3


def _layout_problem(impl, num_layers: int, pp: int) -> str | None:
    """What is wrong with the stages ``impl`` builds for ``num_layers`` layers in ``pp`` stages, or None."""
    where = f"{num_layers} layers in {pp} stages"
    stages = [impl(num_layers, s, pp, 0, 1) for s in range(pp)]
    if not all(hasattr(st, "pp_rank") and hasattr(st, "pp_size") for st in stages):
        return f"{where}: the engine reads stage.pp_rank and stage.pp_size: keep them as attributes"
    owned = [list(st.layers) for st in stages]
    why = _split_problem(owned, num_layers, pp)
    if why:
        return f"{where}: {why}"
    if [st.has_embedding for st in stages] != [s == 0 for s in range(pp)]:
        return f"{where}: the embedding belongs to the first stage only (has_embedding {[st.has_embedding for st in stages]})"
    if [st.has_head for st in stages] != [s == pp - 1 for s in range(pp)]:
        return f"{where}: the final norm and LM head belong to the last stage only (has_head {[st.has_head for st in stages]})"
    for s, st in enumerate(stages):
        if list(st.kv_cache_layers) != owned[s]:
            return (f"{where}: stage {s} keeps a KV cache for layers {list(st.kv_cache_layers)} but runs only "
                    f"{owned[s]}: the cache of layers another stage runs is memory for nothing (pp_kv_every_layer)")
    return None


def _split_problem(owned: list[list[int]], num_layers: int, pp: int) -> str | None:
    """What is wrong with the stages' layers ``owned`` (one list per stage), or None: each layer once, in order."""
    flat = [i for layers in owned for i in layers]
    missing = sorted(set(range(num_layers)) - set(flat))
    base, extra = divmod(num_layers, pp)
    if missing and extra and all(len(layers) == base for layers in owned):
        return (f"layers {missing} belong to no stage ({owned}): num_layers // pp_size each drops the remainder; give "
                f"the num_layers % pp_size = {extra} extra layers to some stages (tplab: one each to the first ones)")
    if missing and all(owned) and missing == [layers[-1] + 1 for layers in owned]:
        return (f"each stage's range ends one layer early ({owned}; layers {missing} belong to no stage): "
                "range(start, stop) stops before stop, so a stage of n layers is range(start, start + n), and the "
                "next stage starts at that stop")
    if not all(owned):
        return f"stage {next(s for s, layers in enumerate(owned) if not layers)} owns no layers ({owned})"
    if missing:
        return (f"layers {missing} belong to no stage ({owned}): the stages' ranges must meet, each starting where the "
                "last stopped")
    if len(flat) != num_layers:
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return f"layers {twice} are owned by two stages ({owned}): each stage starts where the previous one stopped"
    if flat != list(range(num_layers)):
        return f"each stage's layers must follow the previous stage's, in order ({owned})"
    return None


def _verdict(tp, acts, tokens) -> ExerciseResult:
    ref = reference()
    merged = {}
    for a in acts:
        merged.update(a or {})
    diff = first_diff(ref["acts"], merged)            # each sublayer from the stage that owns it; no logits
    if diff:
        return ExerciseResult("pipeline_stage", False, f"inside the engine at TP {tp} x PP {PP}, {diff[0]} is the "
                              f"first sublayer that differs from HF: it {diff[1]}; everything before it matches")
    if tokens != ref["tokens"]:
        return ExerciseResult("pipeline_stage", False, f"every sublayer matches HF, but the greedy tokens at TP {tp} x "
                              f"PP {PP} differ: {tokens} vs HF's {ref['tokens']}")
    return ExerciseResult("pipeline_stage", True, f"the stages split {len(CASES)} (layers, stages) cases right, the "
                          f"boundary carries (hidden, residual) to the right rank, and inside the engine at TP {tp} x PP "
                          f"{PP} every sublayer is within its bound of HF (tplab.tolerance; at most "
                          f"{worst_share(ref['acts'], merged):.0e} of the bound) and {len(tokens)} x {NEW_TOKENS} "
                          "greedy tokens equal HF's")


def judge(impl, tp: int, timeout: float, on_error) -> ExerciseResult:
    """The three steps of the module docstring; ``on_error(name, impl, error, where, group)`` words an exception."""
    where, bound, group = "the stages alone", bound_for(timeout), None
    try:
        for num_layers, pp in CASES:
            why = call_bounded(bound, _layout_problem, impl, num_layers, pp)
            if why:
                return ExerciseResult("pipeline_stage", False, f"the stages alone, {why}")
        where, group = f"at the boundary, TP {tp} x PP {PP}", kept_ranks(tp * PP, timeout, "pp")
        results = group.run(call_bounded, (bound, boundary_probe.run, cloudpickle.dumps(impl), tp, uuid.uuid4().hex,
                                           bound / 2), timeout=timeout)   # its waits end by 3/4 of the bound
        if not all(r["clean"] for r in results):       # a message may be left in flight: other ranks from now on
            group.close()
        why = boundary_probe.problem(results, tp)
        if why:
            return ExerciseResult("pipeline_stage", False, why)
        where, group = f"inside the engine at TP {tp} x PP {PP}", kept_ranks(tp * PP, timeout, "pp")
        ref, parts = reference(), {"pipeline_stage": impl}
        acts = group.run(call_bounded, (bound, stage_activations, engine_config(parts, tp, pipeline_parallel_size=PP,
                                        max_num_batched_tokens=64), ref["prompts"][0]), timeout=timeout)
        params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(ref["prompts"])
        tokens, _ = group.run(call_bounded, (bound, serve_here, engine_config(parts, tp, pipeline_parallel_size=PP),
                                             ref["prompts"], params), timeout=timeout)[0]
    except TimeoutError as e:
        why = ("The boundary worked alone; in the engine a stage receives the pair sent in one tick during the next, "
               "after every rank has ended the first: a send or recv that waits on anything else there waits forever"
               ) if where.startswith("inside") else "A send or recv that no rank answers waits forever"
        return ExerciseResult("pipeline_stage", False, f"{where}: the ranks did not finish in time ({e}). {why}")
    except (Exception, DidNotReturn, SystemExit) as e:  # the learner's code raised, exited or looped
        return on_error("pipeline_stage", impl, e, where, group)
    return _verdict(tp, acts, tokens)
