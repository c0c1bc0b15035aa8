"""``check_part``: a learner's part, run alone and inside the real engine, judged against Hugging Face.

    check_part("row_linear", MyRowParallelLinear, tensor_parallel_size=2)

1. The part alone (``layer_probes``): built on every rank, loaded with small known weights, run on
   known inputs (and on one row alone, a decode step of one sequence); its weights and outputs are
   compared with the right ones and with each usual mistake, so the message can name it.
2. Inside the engine: the shipped model with the part swapped in (``LLM(parts=...)``'s mechanism),
   one prompt prefilled at TP 1 here and at the given TP size in real ranks, every sublayer's output
   on every rank compared with HF's; then greedy tokens at that TP size against HF's ``generate``.

A stub (its own ``raise NotImplementedError``) is "not attempted"; an exception comes back with the
rank and the learner's line; a rank (or this process) still running the learner's code after
``watchdog.bound_for(timeout)`` is stopped there, and its function and line are named; ranks that
wait forever in a collective are stopped at ``timeout``, or ``STRAGGLE_S`` after a rank returned.
"""
import re
import traceback

import cloudpickle

from tplab.distributed.launcher import RankError
from tplab.distributed.stacks import RanksDidNotAnswer
from tplab.engine.parts import FIELDS
from tplab.exercises import (NOT_DONE, ExerciseResult, attention_probe, block_manager_probe, float32_default,
                             is_stub_error, learner_line, solutions, sp_region_probe, watchdog)
from tplab.exercises.layer_diagnoses import DIAGNOSE
from tplab.exercises.in_engine import (NEW_TOKENS, aborted_because, engine_acts, engine_config, first_diff, kept_ranks,
                                      reference, serve, tokens_differ, worst_share)
from tplab.exercises.layer_probes import LAYER_HINTS, SPECS, NamedMistake, probe_in_rank, run_probe, spec_of
from tplab.exercises.watchdog import STRAGGLE_S, DidNotReturn, call_bounded
from tplab.models.checkpoints import tiny_stories
from tplab.models.registry import check_tp_size, load_model_config

LOCAL_PROBES = {"attention": attention_probe,     # parts without collectives: probed in this process only
                "block_manager": block_manager_probe}
RANK_PROBES = {"sp_norm_region": sp_region_probe}  # parts alone in the ranks, by their own probe (collectives)
# Notebook 06's finale's parts, in the model's order, and the notebook whose `# Exercise:` cell writes each.
NOTEBOOK = {"embedding": "06", "qkv_linear": "02", "attention": "04", "row_linear": "02", "gate_up_linear": "02",
            "lm_head": "06", "block_manager": "05"}
# Notebook 07's parts: sequence parallelism's region needs a row_linear that returns partial sums, a stage needs
# stages; notebook 08's exchange needs an MoE model under data parallelism. Those notebooks judge them in engines
# with those on, so notebook 06's finale leaves them out.
EXCHANGE = ("moe_dispatch", "moe_combine")
AFTER_TP = ("sp_norm_region", "pipeline_stage", *EXCHANGE)
ONE_ROW = " on one row (a decode step of one sequence, the T == 1 that one prompt alone gives)"
HINTS = [  # (the part it applies to, or None for any; words in an error, a tuple: all of them; what they mean)
    *(("attention", words, "if you repeated K/V to the query heads before storing them, the cache (H_kv heads per "
                           "slot) has no room for them: store the KV heads, repeat only for the scores")
      for words in ("cannot be broadcast to indexing result", "must have same slice shapes")),  # [slots] =, index_copy_
    ("attention", "must divide the number of heads in", "F.scaled_dot_product_attention takes heads first, "
                  "(H, Lq, D) and (H_kv, Lk, D): q[start:end] and the cache's rows are (L, heads, D), transpose(0, 1) "
                  "them, and the output back"),
    (None, "itensor_view_from_dense", "oneDNN got a tensor of another dtype than the model's: a part returned, "
           "or made, float64 (or another dtype); keep x's dtype (dtype=x.dtype, or .to(x.dtype))"),
    (None, "to have the same dtype", "two tensors of different dtypes met: a part returned, or made, another dtype "
           "than the model's (float64?); keep x's dtype (dtype=x.dtype, or .to(x.dtype))"),
    ("sp_norm_region", "not divisible by tp_size", "a step's T tokens need not divide by tp_size (a lone decode "
                       "token never does): pad them with zero rows to a multiple of tp_size before the reduce-scatter, "
                       "and drop those rows after the all-gather"),
    ("moe_dispatch", "but the traffic sends", "x's rows must be the pairs' rows (T_r k of them, x[order // k]), "
                     "grouped by destination rank, traffic[rank] of them to each: traffic[i][j] is what rank i sends j"),
    ("moe_combine", "but the traffic sends", "sending the outputs back, rank j returns to rank i what i sent it: "
                    "the traffic transposed, [list(col) for col in zip(*traffic)]"),
    ("pipeline_stage", "Pair is not connected", "a rank sent to (or received from) itself: a stage's peer one stage "
                        "away is world rank (pp_rank +/- 1) * tp_size + tp_rank, the same TP rank in that stage"),
    (None, "Received data size doesn't match", "a recv (or a collective) was given a buffer of another size than "
           "the message sent to it, e.g. another dtype: make it the shape and dtype of what is sent"),
    *LAYER_HINTS,
    (None, "process group has not been initialized", "at TP 1 (in this process) there is no process group: skip "
           "the collective when tp_size == 1, or call tplab.distributed.parallel_state.all_reduce(x, tp_size) / "
           "all_gather(x, tp_size), which do"),
]


def _exception_result(name, impl, error, where, group=None) -> ExerciseResult:
    """The result for an exception raised by the learner's part (here, or in a rank of ``group``)."""
    if is_stub_error(impl, error):
        return ExerciseResult(name, None, NOT_DONE)
    if isinstance(error, DidNotReturn):
        return ExerciseResult(name, False, f"{where}: your code {error}")
    stuck = watchdog.from_rank(error) if isinstance(error, RankError) else None
    if stuck:
        return ExerciseResult(name, False, f"{where}, {stuck}")
    if isinstance(error, NamedMistake):
        return ExerciseResult(name, False, f"{where}: {error}")
    aborted = aborted_because(error, group)
    if aborted:
        hint = _hints(name, aborted)
        return ExerciseResult(name, False, f"{where}, rank {error.rank} was aborted by gloo: {aborted}{hint}")
    if isinstance(error, RankError) and not error.remote_traceback:         # the process died: no exception
        return ExerciseResult(name, False, f"{where}, {error}: it ended without a Python exception (os._exit, a "
                                           "crash inside native code, or the system's out-of-memory killer)")
    if isinstance(error, RankError):
        last = error.remote_traceback.strip().splitlines()[-1]
        returned = re.match(r"(?:[\w.]+\.)?(?:ForgotReturn|NamedMistake): (.+)", last)   # a probe in the rank named it
        if returned:
            return ExerciseResult(name, False, f"{where}, rank {error.rank}: {returned[1]}")
        if last.startswith("NotImplementedError") and learner_line(impl, error.remote_traceback):
            return ExerciseResult(name, None, NOT_DONE)
        line = learner_line(impl, error.remote_traceback)
        return ExerciseResult(name, False, f"{where}, rank {error.rank} raised {last}{line}"
                                           f"{_hints(name, last + line)}")
    if isinstance(error, TimeoutError):
        stuck = error.stragglers() if isinstance(error, RanksDidNotAnswer) and group is not None else ""
        return ExerciseResult(name, False, f"{where}: the ranks did not finish in time and were all stopped"
                              + (f": {stuck}" if stuck else "") + ". A collective that not every rank reaches waits "
                              "forever (e.g. an all_reduce inside `if tp_rank == 0:`, or a rank that returns before it)")
    line = learner_line(impl, "".join(traceback.format_exception(error)))
    return ExerciseResult(name, False, f"{where}: raised {type(error).__name__}: {error}{line}"
                                       f"{_hints(name, str(error) + line)}")


def _hints(name: str, text: str) -> str:
    """The ``HINTS`` for part ``name`` whose words are in ``text``, each as ". Hint: ..."; where the part has a
    hint of its own for some words, the general one for the same words is left out."""
    found = [(part, words, hint) for part, words, hint in HINTS if part in (None, name)
             and all(w in text for w in ((words,) if isinstance(words, str) else words))]
    own = {words for part, words, _ in found if part is not None}
    return "".join(f". Hint: {hint}" for part, words, hint in found if part is not None or words not in own)


def _describe_diffs(tp, per_rank) -> str | None:
    """``per_rank``: ``in_engine.first_diff`` of each rank. A sentence naming the first sublayer that differs."""
    bad = [(r, d) for r, d in enumerate(per_rank) if d is not None]
    if not bad:
        return None
    r, (name, what) = min(bad, key=lambda rd: list(reference()["acts"]).index(rd[1][0]))   # first in forward order
    ranks = ""
    if tp > 1:
        ranks = f" on rank {r}" + (f" (ranks {[b[0] for b in bad]} differ)" if len(bad) > 1 else "")
    return (f"inside the engine at TP {tp}, {name} is the first sublayer that differs from HF{ranks}: it {what}; "
            "everything before it matches")


def _alone(name, impl, tp: int, group=None, timeout: float = 60.0) -> str | None:
    """Stage 1 at TP ``tp`` (in this process when ``group`` is None): what is wrong with the part alone."""
    bound = watchdog.bound_for(timeout)
    if name in LOCAL_PROBES:                          # no collectives: once, in this process
        if group is not None:
            return None
        ok, why = LOCAL_PROBES[name].diagnose(call_bounded(bound, LOCAL_PROBES[name].run, impl))
        return None if ok else f"the part alone: {why}"
    if name in RANK_PROBES:                           # needs real ranks: at TP > 1 only
        if group is None:
            return None
        blob = cloudpickle.dumps(impl)                # unpickled in the ranks inside the probe's watch
        results = group.run(call_bounded, (bound, RANK_PROBES[name].run, blob), timeout=timeout, straggle=STRAGGLE_S)
        ok, why = RANK_PROBES[name].diagnose(results, tp)
        return None if ok else f"the part alone: {why}"
    if name not in SPECS:
        return None
    for forward, one_row in ((False, False), (True, False), (True, True)):   # the loaded weights, then the output
        spec, where = spec_of(name, one_row), f"the layer alone at TP {tp}" + (ONE_ROW if one_row else "")
        try:
            results = [call_bounded(bound, run_probe, impl, spec, 0, 1, forward)] if group is None else \
                group.run(call_bounded, (bound, probe_in_rank, impl, name, tp, forward, one_row), timeout=timeout,
                          straggle=STRAGGLE_S)
        except (Exception, DidNotReturn, SystemExit) as e:
            if not one_row:
                raise
            return _exception_result(name, impl, e, where, group).message    # fails only where T == 1: say so
        ok, why = DIAGNOSE[name](spec, results, tp)
        if not ok:
            return f"{where}, {why}" if tp > 1 else f"{where}: {why.removeprefix('rank 0: ')}"
    return None


def judge_in_engine(name, impl, parts: dict, tp: int, timeout: float, unit: bool = True) -> ExerciseResult:
    """Stages 1 (when ``unit``) and 2 of the module docstring for ``parts`` (``{field: replacement}``) at TP 1
    and ``tp``. ``impl`` is the learner's class or function (or a list of them), to find their lines."""
    ref, where, bound, group = reference(), "at TP 1", watchdog.bound_for(timeout), None
    try:
        why = _alone(name, impl, 1, timeout=timeout) if unit else None
        if why:
            return ExerciseResult(name, False, why)
        acts1 = call_bounded(bound, engine_acts, engine_config(parts, 1), ref["prompts"][0])
        where, group = f"at TP {tp}", kept_ranks(tp, timeout)
        why = _alone(name, impl, tp, group, timeout) if unit else None
        if why:
            return ExerciseResult(name, False, why)
        acts = group.run(call_bounded, (bound, engine_acts, engine_config(parts, tp), ref["prompts"][0]),
                         timeout=timeout, straggle=STRAGGLE_S)
        tokens, want, stats = serve(group, parts, tp, timeout)
    except (Exception, DidNotReturn, SystemExit) as e:  # the learner's code raised, exited or looped; ranks hung
        return _exception_result(name, impl, e, where, group)
    return _verdict(name, parts, tp, [acts1], acts, tokens, want, stats)


def _verdict(name, parts, tp, acts1, acts, tokens, want, stats) -> ExerciseResult:
    """Stage 2's comparisons with HF: every sublayer at TP 1 and ``tp``, then the greedy tokens."""
    ref = reference()
    for size, rank_acts in ((1, acts1), (tp, acts)):
        why = _describe_diffs(size, [first_diff(ref["acts"], a) for a in rank_acts])
        if why:
            return ExerciseResult(name, False, why)
    if tokens != want:
        return ExerciseResult(name, False, tokens_differ(tokens, want, tp, "block_manager" in parts))
    if "block_manager" in parts and not (stats["num_preemptions"] and stats["prefix_cache_hit_blocks"]):
        return ExerciseResult(name, False, f"the tokens are right, but the workload should have preempted and hit "
                              f"the prefix cache: {stats['num_preemptions']} preemptions, "
                              f"{stats['prefix_cache_hit_blocks']} prefix-cache hit blocks")
    most = max(worst_share(ref["acts"], a) for a in [*acts1, *acts])
    served = (f", {stats['num_preemptions']} preemption(s) and {stats['prefix_cache_hit_blocks']} prefix-cache hit "
              "blocks on the way" if "block_manager" in parts else "")
    return ExerciseResult(name, True, f"inside the engine every sublayer is within its bound of HF (tplab.tolerance) "
                          f"at TP 1 and TP {tp} on every rank (at most {most:.0e} of the bound), and {len(tokens)} x "
                          f"{NEW_TOKENS} greedy tokens at TP {tp} equal HF's{served}")


def check_part(name: str, impl, tensor_parallel_size: int = 2, timeout: float = 90.0) -> ExerciseResult:
    """Run the shipped model with ``impl`` as part ``name`` (a field of ``tplab.Parts``) at TP 1 and at
    ``tensor_parallel_size`` against HF (``pipeline_stage``: at ``tensor_parallel_size`` x 2 pipeline stages, after
    its layouts and its boundary alone; ``sp_norm_region``: with sequence parallelism; ``moe_dispatch`` and
    ``moe_combine``: alone in 2 ranks, then the shipped MoE model at ``data_parallel_size=2`` with expert
    parallelism, whatever ``tensor_parallel_size`` says). ``.ok`` is True, False, or None for an untouched stub;
    ``.message`` names the first sublayer that differs, on which rank, and the mistake where it
    recognises one."""
    _check_arguments({name: impl}, tensor_parallel_size)
    with float32_default():
        return _judge_part(name, impl, tensor_parallel_size, timeout)


def _judge_part(name: str, impl, tensor_parallel_size: int, timeout: float) -> ExerciseResult:
    if name == "pipeline_stage":                       # its own checks: layouts, the boundary, the engine at PP 2
        from tplab.exercises import pipeline_probe
        return pipeline_probe.judge(impl, tensor_parallel_size, timeout, _exception_result)
    if name in EXCHANGE:                               # alone in 2 watched ranks, then the MoE model at DP 2
        from tplab.exercises import exchange_probe
        return exchange_probe.judge(name, impl, timeout, _exception_result)
    return judge_in_engine(name, impl, {name: impl}, tensor_parallel_size, timeout)


def _check_arguments(parts: dict, tensor_parallel_size) -> None:
    """Refuse, before anything runs, what no check can judge: an unknown part, ``experts`` (the shipped dense model
    never builds it), an instance or a function where the engine builds a class, a TP size that is no size, or one
    that does not split the shipped model's heads and sizes."""
    unknown = sorted(set(parts) - set(FIELDS))
    if unknown:
        raise ValueError(f"no part named {unknown}; the parts are {list(FIELDS)}")
    if "experts" in parts:
        raise ValueError("check_part runs the shipped dense model, which has no experts: judge an experts part in "
                         "LLM(tplab.models.tiny_moe(), parts={'experts': ...}) against HF (notebook 08)")
    objects = [p for p, impl in parts.items() if p in solutions.PARTS and not isinstance(impl, type)]
    if objects:
        raise ValueError(f"{objects[0]}: pass the class itself (e.g. {solutions.PARTS[objects[0]]}), not an instance "
                         "or a function: the engine builds one per layer, on every rank")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
    if not set(parts) <= set(EXCHANGE):            # the exchange's check runs at DP 2 whatever the TP size
        try:                                       # the shipped model's own refusal, before any rank starts
            check_tp_size(load_model_config(tiny_stories()), tensor_parallel_size)
        except ValueError as e:
            raise ValueError(f"the check runs the shipped model (models.tiny_stories()), and {e}") from None


def check_engine(parts: dict, tensor_parallel_size: int = 2, timeout: float = 120.0) -> ExerciseResult:
    """Notebook 06's finale: every part in ``parts`` (``{field of tplab.Parts: your class}``, e.g.
    ``workbook.your_parts()``) at once, in one engine at TP 1 and ``tensor_parallel_size``, against HF
    sublayer by sublayer and token for token."""
    name = "your engine"
    _check_arguments(parts, tensor_parallel_size)
    later = sorted(set(parts) & set(AFTER_TP))     # judged in notebooks 07 and 08, where SP, PP or DP is on
    parts = {k: v for k, v in parts.items() if k not in AFTER_TP}
    nb07, nb08 = [p for p in later if p not in EXCHANGE], [p for p in later if p in EXCHANGE]
    aside = (f" (notebook 07's {', '.join(nb07)}: judged there, with sequence / pipeline parallelism on)" if nb07
             else "") + (f" (notebook 08's {', '.join(nb08)}: judged there, with data parallelism on)" if nb08 else "")
    missing = [p for p in NOTEBOOK if p not in parts]
    stubs = [p for p, impl in parts.items() if _is_stub(impl, p)]
    if not parts:
        return ExerciseResult(name, None, "not attempted yet: write the part exercises (notebooks 02, 04, 05 and "
                                          "06: `# Exercise: row_linear` ...), run their cells, then this one" + aside)
    if stubs:
        where = ", ".join(f"{p} (notebook {NOTEBOOK[p]})" if p in NOTEBOOK else p for p in stubs)
        return ExerciseResult(name, None, f"not attempted yet: still stubs: {where}. Write them in their "
                              "`# Exercise:` cells, run those cells, then this one; "
                              "or hand check_engine only the parts you finished" + aside)
    with float32_default():
        result = judge_in_engine(name, list(parts.values()), parts, tensor_parallel_size, timeout, unit=False)
    if result.ok and missing:
        result.message += f" (tplab's own {', '.join(missing)}: write them too to make it all yours)"
    result.message += aside
    return result


def _is_stub(impl, name) -> bool:
    """Whether ``impl`` is still the exercise's stub: probing it raises its own NotImplementedError."""
    try:
        if name in SPECS:
            call_bounded(None, run_probe, impl, spec_of(name), 0, 1)
        elif name in LOCAL_PROBES:
            call_bounded(None, LOCAL_PROBES[name].run, impl)
    except Exception as e:
        return is_stub_error(impl, e)
    except DidNotReturn:                  # not a stub: the check itself stops it again and says where
        pass
    return False
