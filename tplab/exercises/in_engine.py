"""Running a learner's parts inside the engine for ``check_part``: HF's answers on the shipped model
(computed once), the engine config with the parts checked for a missing ``return``, one prefill with
hooks on every sublayer (in this process or in a rank), and greedy serving through ``Worker``s in
ranks kept from one check to the next. Those ranks write what C++ prints (gloo's reason for aborting a
rank) to a file each, so that a rank that dies is reported with it, not only with its signal."""
import atexit
import functools
import os
import re
import tempfile
import weakref

import torch

from tplab.distributed.launcher import RankError, RankGroup
from tplab.engine.config import EngineConfig
from tplab.engine.probe import load_model, probe
from tplab.engine.sampling import SamplingParams
from tplab.engine.worker import Worker
from tplab.models.checkpoints import tiny_stories
from tplab.exercises import FORGOT_RETURN
from tplab.exercises.layer_probes import ForgotReturn
from tplab.exercises.watchdog import STRAGGLE_S, bound_for, call_bounded
from tplab import golden
from tplab.golden import activation_names, all_tokens, hf_activations, hf_greedy_tokens
from tplab.tolerance import RTOL

PROMPTS = ["Once upon a time, there was a little", "The cat sat in the sun and"]
# a shared prefix, more KV than the cache holds: the block manager shares blocks, preempts and recomputes
WORKLOAD = [PROMPTS[0] + " girl", PROMPTS[0] + " boy", PROMPTS[0] + " dog", PROMPTS[0] + " bird"]
WORKLOAD_ENGINE = dict(block_size=4, num_kv_blocks=14, max_num_seqs=4, enable_prefix_caching=True)
NEW_TOKENS = 12


def hf_reference(model_dir, texts: list[str], workload: list[str] = ()) -> dict:
    """HF's own model on ``model_dir``: ``texts`` tokenized ("prompts"), HF's greedy tokens for each, its
    activations for the first; the same prompts and tokens for ``workload``, if any."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, more = ([tokenizer.encode(t) for t in group] for group in (texts, workload))
    return {"model": str(model_dir), "prompts": prompts, "tokens": hf_greedy_tokens(hf, prompts, NEW_TOKENS),
            "acts": hf_activations(hf, prompts[0]), "workload": more,
            "workload_tokens": hf_greedy_tokens(hf, more, NEW_TOKENS) if more else []}


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    """HF on the shipped model: ``PROMPTS`` and ``WORKLOAD`` (``hf_reference``)."""
    return hf_reference(tiny_stories(), PROMPTS, WORKLOAD)


def checked(obj):
    """``obj`` with a check that it never returns None (a part's forward, or a function part)."""
    if isinstance(obj, type):
        return obj                                   # classes: forward hooks, see engine_acts
    @functools.wraps(obj)
    def part(*args, **kwargs):
        out = obj(*args, **kwargs)
        if out is None:
            raise ForgotReturn(f"{obj.__name__} {FORGOT_RETURN}")
        return out
    return part


def engine_config(parts, tp, **settings) -> EngineConfig:
    """The shipped model's engine with ``parts`` (each checked for a missing ``return``), made here once."""
    if "sp_norm_region" in parts and tp == 1:        # at TP 1 there is no region: the engine is tplab's own
        parts = {k: v for k, v in parts.items() if k != "sp_norm_region"}
    elif "sp_norm_region" in parts:                  # the region runs only under sequence parallelism
        settings = {"sequence_parallel": True, **settings}
    if "static_decode" in parts:                     # a step at fixed shapes runs where asked for, eagerly on a CPU
        settings = {"static_decode": True, **settings}
    return EngineConfig(model=reference()["model"], tensor_parallel_size=tp, device="cpu",
                        parts={k: checked(v) for k, v in parts.items()}, **settings)


def engine_acts(cfg, prompt):
    """This rank's activations for one prefill of ``prompt`` in the engine ``cfg`` (in a rank, or here)."""
    model = load_model(cfg)
    classes = tuple(v for v in cfg.parts.replaced().values() if isinstance(v, type))

    def no_none(module, _, out):
        if out is None:
            raise ForgotReturn(f"{type(module).__name__}.forward {FORGOT_RETURN}")
    for module in model.modules():
        if classes and isinstance(module, classes):
            module.register_forward_hook(no_none)
    out = probe(model, prompt, outputs_of=activation_names(len(model.model.layers))[:-1])
    acts = {**out.outputs, "logits": out.logits.float().cpu()}
    return all_tokens(model, acts, len(prompt)) if model.sequence_parallel else acts   # SP: back to all T tokens


def first_diff(ref: dict, acts: dict) -> tuple[str, str] | None:
    """The first activation (``ref``'s forward order, those in ``acts``) that is not within its bound of HF's
    (``golden.compare``: ``tplab.tolerance``, relative to the activation's size), and what is wrong with it, in
    words that follow "it": another shape than HF's, NaN or inf, or how far from HF's it is; None when none is."""
    for name in (n for n in ref if n in acts):
        if acts[name].shape != ref[name].shape:                        # golden.compare takes equal shapes only
            return name, f"has shape {tuple(acts[name].shape)}, HF's {tuple(ref[name].shape)}"
        [row] = golden.compare({name: ref[name]}, acts)
        if row.ok:
            continue
        if row.nonfinite:
            return name, f"holds NaN or inf ({row.nonfinite} of its {acts[name].numel()} values)"
        times = f"{row.share:.1f}".removesuffix(".0")                   # "inf" where the bound is 0
        return name, (f"is up to {row.max_abs:.1e} from HF's, {times} times its bound {row.bound:.1e} "
                      f"({RTOL[torch.float32]:.1e} of HF's largest value there, tplab.tolerance)")
    return None


def worst_share(ref: dict, acts: dict) -> float:
    """``golden.worst`` of ``acts`` against ``ref`` (those in ``acts``): the largest share of its bound any reaches."""
    return golden.worst(golden.compare({n: r for n, r in ref.items() if n in acts}, acts))


_groups: dict[tuple[str, int], RankGroup] = {}
_stderr: "weakref.WeakKeyDictionary[RankGroup, list[str]]" = weakref.WeakKeyDictionary()


def kept_ranks(tp: int, timeout: float, purpose: str = "tp") -> RankGroup:
    """``tp`` gloo ranks kept from one check to the next (where ranks are spawned, starting them costs
    seconds); a group that a failure closed is replaced. They end with this process. ``purpose="pp"``: other
    ranks, for pipeline checks, whose engines set a t x p layout in their processes that TP checks must not see."""
    group = _groups.get((purpose, tp))
    if group is None or group.closed:
        group = _groups[purpose, tp] = RankGroup(tp, backend="gloo", timeout=timeout)
        paths = [tempfile.mkstemp(prefix=f"tplab-rank{r}-", suffix=".stderr") for r in range(tp)]
        for fd, path in paths:
            os.close(fd)
            atexit.register(_remove, path)
        _stderr[group] = [path for _, path in paths]
        group.run(_stderr_to, (_stderr[group],))
    return group


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _stderr_to(paths: list[str]) -> None:
    """In a rank: what C++ writes to stderr (file descriptor 2) goes to this rank's file from now on."""
    import torch.distributed as dist
    fd = os.open(paths[dist.get_rank()], os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def aborted_because(error, group) -> str | None:
    """For a rank of ``group`` that died (a signal, no Python traceback of its own): what C++ said as it aborted
    it (gloo's ``what():``), or None."""
    paths = _stderr.get(group) if group is not None else None
    if not isinstance(error, RankError) or not paths or not str(error).startswith(f"rank {error.rank} died"):
        return None
    try:
        with open(paths[error.rank], errors="replace") as f:
            text = f.read()[-20000:]
    except (OSError, IndexError):
        return None
    found = re.findall(r"what\(\):\s*(.+)", text) or re.findall(r"(terminate called.+)", text)
    return found[-1].strip() if found else None


def close_kept_ranks() -> None:
    """End the kept ranks now (a test module's teardown; a notebook lets them end with its kernel)."""
    while _groups:
        _groups.popitem()[1].close()


def serve(group, parts, tp, timeout) -> tuple[list, list[list[int]], dict]:
    """Greedy tokens through one engine of ``parts`` in ``group``: the prompts, or with a block manager part
    the workload (shared prefixes, a cache too small for all); and the HF tokens to compare with, the stats."""
    ref, workload = reference(), "block_manager" in parts
    settings = WORKLOAD_ENGINE if workload else {}
    prompts = ref["workload" if workload else "prompts"]
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    tokens, stats = group.run(call_bounded, (bound_for(timeout), serve_here, engine_config(parts, tp, **settings),
                                             prompts, params), timeout=timeout, straggle=STRAGGLE_S)[0]
    return tokens, ref["workload_tokens" if workload else "tokens"], stats


def serve_here(cfg, prompts, params) -> tuple[list[list[int]], dict]:
    """In a rank: one ``Worker`` of ``cfg`` (the engine ``LLM`` runs) generates; its tokens and stats."""
    worker = Worker(cfg)
    return [ids for ids, _, _ in worker.generate(prompts, params)], worker.stats()


def tokens_differ(tokens: list[list[int]], want: list[list[int]], tp: int, workload: bool) -> str:
    """Why greedy tokens served at TP ``tp`` differ from HF's ``want``, in words: where the first difference is
    says which step made it (``workload``: ``serve`` ran the block manager's workload)."""
    i = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
    said = (f"a prompt prefilled alone matches HF sublayer by sublayer, but the greedy tokens of prompt {i} at TP {tp} "
            f"differ: {tokens[i]} vs HF's {want[i]}")
    if tokens[i][:1] == want[i][:1]:
        return f"{said} (decode steps go wrong)"
    return (f"{said}: the first already, which a prefill samples. Serving adds " + ("prompts whose prefix comes from "
            "the prefix cache (attention over cached keys with several new queries, and the blocks they share)"
            if workload else "several prompts prefilled together in one step (each sequence's own keys and mask)"))
