"""``check_part("pipeline_stage", ...)``: a learner's pipeline stage, judged in three steps.

1. Alone, in this process: which layers each stage owns, for several (layers, stages), whether the first
   stage embeds and the last holds the head, and which layers it keeps a KV cache for.
2. The boundary, in real ranks (t x 2): stage 0 sends a known ``(hidden, residual)`` per TP rank, and each
   TP rank of stage 1 must receive exactly its peer's pair, in that order.
3. Inside the engine at (t, 2) on the shipped model: every sublayer, each from the stage that owns it,
   against HF (``golden.stage_activations``), then greedy tokens against HF's.
"""
import torch

from tplab.engine.config import EngineConfig
from tplab.engine.sampling import SamplingParams
from tplab.exercises import ExerciseResult
from tplab.exercises.in_engine import NEW_TOKENS, kept_ranks, reference, serve_here
from tplab.exercises.watchdog import bound_for, call_bounded
from tplab.golden import stage_activations

CASES = [(4, 2), (4, 4), (5, 2), (5, 4), (3, 2), (28, 4), (24, 8)]     # (layers, stages)
ROWS, E, PP = 3, 8, 2                                                  # the boundary probe's pair; stages


def _layout_problem(impl, num_layers: int, pp: int) -> str | None:
    """What is wrong with the stages ``impl`` builds for ``num_layers`` layers in ``pp`` stages, or None."""
    where = f"{num_layers} layers in {pp} stages"
    stages = [impl(num_layers, s, pp, 0, 1) for s in range(pp)]
    if not all(hasattr(st, "pp_rank") and hasattr(st, "pp_size") for st in stages):
        return f"{where}: the engine reads stage.pp_rank and stage.pp_size: keep them as attributes"
    owned = [list(st.layers) for st in stages]
    flat = [i for layers in owned for i in layers]
    if any(not layers for layers in owned):
        return f"{where}: stage {next(s for s, ls in enumerate(owned) if not ls)} owns no layers ({owned})"
    if sorted(flat) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(flat))
        why = (f"layers {missing} belong to no stage: num_layers // pp_size each drops the remainder; give the "
               "num_layers % pp_size extra layers to some stages (tplab: one each to the first ones)") if missing \
            else f"a layer is owned twice ({owned})"
        return f"{where}: {why}"
    if flat != list(range(num_layers)):
        return f"{where}: each stage's layers must follow the previous stage's, in order ({owned})"
    if [st.has_embedding for st in stages] != [s == 0 for s in range(pp)]:
        return f"{where}: the embedding belongs to the first stage only (has_embedding {[st.has_embedding for st in stages]})"
    if [st.has_head for st in stages] != [s == pp - 1 for s in range(pp)]:
        return f"{where}: the final norm and LM head belong to the last stage only (has_head {[st.has_head for st in stages]})"
    for s, st in enumerate(stages):
        if list(st.kv_cache_layers) != owned[s]:
            return (f"{where}: stage {s} keeps a KV cache for layers {list(st.kv_cache_layers)} but runs only "
                    f"{owned[s]}: the cache of layers another stage runs is memory for nothing (pp_kv_every_layer)")
    return None


def boundary_run(impl, tp: int):
    """In each rank of t x 2: stage 0 sends its TP rank's known pair, stage 1 receives; what stage 1 got."""
    import torch.distributed as dist
    rank = dist.get_rank()
    tp_rank, pp_rank = rank % tp, rank // tp
    stage = impl(4, pp_rank, PP, tp_rank, tp)
    got = None
    if pp_rank == 0:
        stage.send(*pairs(tp)[tp_rank])
    else:
        got = stage.recv(ROWS, E, torch.float32, torch.device("cpu"))
    dist.barrier()                                                # every pair has arrived before anyone returns
    return None if got is None else tuple(x.clone() for x in got)


def pairs(tp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (hidden, residual) each TP rank of stage 0 sends: all different."""
    gen = torch.Generator().manual_seed(tp)
    return [(torch.randn(ROWS, E, generator=gen), 10 + torch.randn(ROWS, E, generator=gen)) for _ in range(tp)]


def _boundary_problem(results, tp: int) -> str | None:
    sent = pairs(tp)
    same = lambda a, b: a.shape == b.shape and torch.equal(a, b)
    for rank, got in enumerate(results[tp:]):                     # the ranks of stage 1
        hidden, residual = sent[rank]
        where = f"the boundary at TP {tp}: rank {tp + rank} (stage 1, TP rank {rank})"
        if not isinstance(got, tuple) or len(got) != 2:
            return f"{where}: recv must return the pair (hidden, residual), got {type(got).__name__}"
        if same(got[0], hidden) and same(got[1], residual):
            continue
        if same(got[0], residual) and same(got[1], hidden):
            return f"{where} received residual and hidden swapped: receive them in the order send sent them"
        if same(got[0], hidden):
            return (f"{where} received the hidden state but not the residual stream: both must cross (the next "
                    "stage starts from residual + hidden; without the residual it loses every earlier layer)")
        if any(same(got[0], h) for h, _ in sent):
            return f"{where} received another TP rank's pair: send to the same TP rank of the next stage, world rank (pp_rank + 1) * tp_size + tp_rank"
        return f"{where} received something else than what stage 0's TP rank {rank} sent"
    return None


def _engine_config(impl, tp: int, **settings) -> EngineConfig:
    return EngineConfig(model=reference()["model"], tensor_parallel_size=tp, pipeline_parallel_size=PP, device="cpu",
                        parts={"pipeline_stage": impl}, **settings)


def _verdict(impl, tp, acts, tokens) -> ExerciseResult:
    ref = reference()
    merged = {}
    for a in acts:
        merged.update(a or {})
    for name in ref["acts"]:
        if name in merged:
            diff = float((merged[name] - ref["acts"][name]).abs().max()) if merged[name].shape == ref["acts"][name].shape \
                else float("inf")
            if not diff <= 1e-4:
                return ExerciseResult("pipeline_stage", False, f"inside the engine at TP {tp} x PP {PP}, {name} is the "
                                      f"first sublayer that differs from HF: by {diff:.1e}; everything before it matches")
    if tokens != ref["tokens"]:
        return ExerciseResult("pipeline_stage", False, f"every sublayer matches HF, but the greedy tokens at TP {tp} x "
                              f"PP {PP} differ: {tokens} vs HF's {ref['tokens']}")
    return ExerciseResult("pipeline_stage", True, f"the stages split {len(CASES)} (layers, stages) cases right, the "
                          f"boundary carries (hidden, residual) to the right rank, and inside the engine at TP {tp} x PP "
                          f"{PP} every sublayer is within 1e-4 of HF and {len(tokens)} x {NEW_TOKENS} greedy tokens equal HF's")


def judge(impl, tp: int, timeout: float, on_error) -> ExerciseResult:
    """The three steps of the module docstring; ``on_error(name, impl, error, where)`` words an exception."""
    where, bound = "the stages alone", bound_for(timeout)
    try:
        for num_layers, pp in CASES:
            why = call_bounded(bound, _layout_problem, impl, num_layers, pp)
            if why:
                return ExerciseResult("pipeline_stage", False, f"the stages alone, {why}")
        where, group = f"at the boundary, TP {tp} x PP {PP}", kept_ranks(tp * PP, timeout, "pp")
        why = _boundary_problem(group.run(call_bounded, (bound, boundary_run, impl, tp), timeout=timeout), tp)
        if why:
            return ExerciseResult("pipeline_stage", False, why)
        where = f"inside the engine at TP {tp} x PP {PP}"
        ref = reference()
        acts = group.run(call_bounded, (bound, stage_activations, _engine_config(impl, tp, max_num_batched_tokens=64),
                                        ref["prompts"][0]), timeout=timeout)
        params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(ref["prompts"])
        tokens, _ = group.run(call_bounded, (bound, serve_here, _engine_config(impl, tp), ref["prompts"], params),
                              timeout=timeout)[0]
    except TimeoutError as e:
        return ExerciseResult("pipeline_stage", False, f"{where}: the ranks did not finish in time ({e}). A recv that "
                              "no rank answers waits forever: stage s sends to world rank (s + 1) * tp_size + tp_rank "
                              "and receives from (s - 1) * tp_size + tp_rank, the same TP rank one stage away")
    except Exception as e:  # the learner's code raised, here or in a rank
        return on_error("pipeline_stage", impl, e, where)
    return _verdict(impl, tp, acts, tokens)
