"""The one place where the engine's replaceable parts are chosen.

An engine is built from a ``Parts``: its fields, below, are every replaceable piece (the layer classes and
functions its model is made of, how a layer multiplies, the checkpoint loader, the block manager, the pipeline
stage, the experts and their exchange, ...). ``resolve(bugs, parts)`` starts from tplab's own, swaps in the named
pitfalls (``LLM(bugs=[...])``, found by name in the catalogue ``tplab/__init__.py`` hands it) and a learner's own
parts (``LLM(parts={...})``), and refuses two replacements of the same field; ``for_device`` then puts tplab's own
kernel part back where a replacement says it cannot run on this device or dtype. The experts' exchange under data
parallelism (``moe_dispatch``, ``moe_combine``) is called by the experts, so a replaced one is handed to the
``experts`` class here, as its ``dispatch=`` / ``combine=``. It runs once, in the process that creates the
``LLM``; the resolved ``Parts`` travels to every rank inside the ``EngineConfig``, and nothing in the engine asks
which bug is on.
"""
import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from tplab.engine.block_manager import BlockManager
from tplab.engine.model_runner import token_positions
from tplab.engine.static_decode import StaticDecode
from tplab.kernels.attend import sdpa_attend
from tplab.kernels.gemm import Gemm
from tplab.layers.attention import Attention
from tplab.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tplab.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tplab.layers.moe import FusedMoE
from tplab.layers.moe_exchange import all_to_all_combine, all_to_all_dispatch
from tplab.layers.rotary import apply_rotary
from tplab.models.loader import load_weights
from tplab.models.pipeline import PipelineStage
from tplab.models.sequence_parallel import SequenceParallelNormRegion


@dataclass(frozen=True)
class Parts:
    """What an engine is built from. Each default's docstring is the contract a replacement keeps."""
    embedding: type = VocabParallelEmbedding        # token ids -> hidden states, vocab split over ranks
    lm_head: type = ParallelLMHead                  # hidden states -> full logits on every rank
    qkv_linear: type = QKVParallelLinear            # fused q|k|v, column parallel by head
    gate_up_linear: type = MergedColumnParallelLinear  # fused gate|up, column parallel
    row_linear: type = RowParallelLinear            # o_proj and down_proj: partial sums, all-reduced
    experts: type = FusedMoE                        # an MoE layer's experts: route, dispatch, expert MLPs, combine
    moe_dispatch: Callable = all_to_all_dispatch    # under DP: each (token, expert) pair to its expert's rank
    moe_combine: Callable = all_to_all_combine      # under DP: the experts' outputs back, weighted, per token
    gemm: type = Gemm                               # each linear layer's linear_method (on CPU: oneDNN, packed)
    attention: type = Attention                     # writes K/V into the paged cache, then attends
    attend: Callable = sdpa_attend                  # softmax(q k^T) v under the causal mask
    apply_rope: Callable = apply_rotary             # rotate q, k by cos/sin
    positions: Callable = token_positions           # a step's token positions: checked against the cache
                                                    # lengths (a wrong one raises), never used in their place
    load_weights: Callable = load_weights           # checkpoint -> this rank's parameters
    block_manager: type = BlockManager              # which KV blocks each sequence holds
    sp_norm_region: type = SequenceParallelNormRegion   # sequence parallel: reduce-scatter, + residual, norm, gather
    pipeline_stage: type = PipelineStage            # a stage's layers, and what crosses to the next stage
    static_decode: type = StaticDecode              # decode steps at fixed shapes; on CUDA, CUDA graphs

    def replaced(self) -> dict[str, object]:
        """The fields that differ from tplab's own parts."""
        default = Parts()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not getattr(default, f.name)}


FIELDS = tuple(f.name for f in dataclasses.fields(Parts))
BUILT_BY_ENGINE = {f.name: f.type is type for f in dataclasses.fields(Parts)}  # field -> whether the engine builds it
# Where ``LLM(bugs=[...])`` finds the pitfalls by name. The catalogue (``tplab.bugs``) is on the teaching side,
# which the engine never imports: the package's root module hands the engine a function that loads it
# (``provide_bugs``), called only when a bug is asked for, so an engine built without bugs never loads it.
_bug_catalogues: list[Callable[[], dict]] = []


def provide_bugs(load_catalogue: Callable[[], dict]) -> None:
    """Make the bugs of ``load_catalogue()`` (name -> ``{field of Parts: replacement}``) known by name."""
    _bug_catalogues.append(load_catalogue)


def known_bugs() -> dict[str, dict[str, object]]:
    """Every bug known by name: name -> ``{field of Parts: replacement}`` (loads the catalogues)."""
    return {name: swaps for load in _bug_catalogues for name, swaps in load().items()}


def _describe(value) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _builds(part) -> bool:
    """Whether the engine can build ``part``: a class, or a class with some arguments given (``functools.partial``)."""
    return isinstance(part.func if isinstance(part, functools.partial) else part, type)


def bug_names(bugs) -> tuple[str, ...]:
    """``bugs`` as given to ``LLM`` (a name, a list of names, or None) as a tuple of names."""
    if isinstance(bugs, str):
        return (bugs,)
    if bugs and not (isinstance(bugs, (list, tuple)) and all(isinstance(b, str) for b in bugs)):
        raise ValueError(f"bugs must be a bug's name or a list of names, got {bugs!r}")
    return tuple(bugs or ())


def resolve(bugs=(), parts=None) -> Parts:
    """tplab's parts with the named bugs and then ``parts`` (a ``Parts`` or a dict of field -> replacement)
    swapped in. Raises a ValueError naming both replacements when two of them replace the same field."""
    names = list(bug_names(bugs))
    catalogue = known_bugs() if names else {}
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise ValueError(f"unknown bug name(s) {unknown}; known: {list(catalogue)}")
    if not (parts is None or isinstance(parts, (Parts, dict))):
        raise ValueError(f"parts must be a dict of field -> your class or function, got {type(parts).__name__}")
    mine = parts.replaced() if isinstance(parts, Parts) else dict(parts or {})
    odd = {f: r for f, r in mine.items() if not callable(r)}
    if odd:
        raise ValueError(f"parts: each is a class or a function, not {odd!r:.120}")
    wrong = sorted(set(mine) - set(FIELDS))
    if wrong:
        raise ValueError(f"parts has unknown field(s) {wrong}; the fields of tplab.Parts are {list(FIELDS)}")
    for field, replacement in mine.items():
        if BUILT_BY_ENGINE[field] and not _builds(replacement):
            given = (f"the function {_describe(replacement)}" if hasattr(replacement, "__qualname__")
                     else f"an instance of {_describe(replacement)}")
            raise ValueError(f"parts[{field!r}]: pass the class itself (as tplab's "
                             f"{getattr(Parts(), field).__name__}), not {given}: the engine builds one wherever the "
                             "model needs it, on every rank")
    chosen: dict[str, tuple[str, object]] = {}      # field -> (who replaced it, replacement)
    for who, field, replacement in _swaps(names, catalogue, mine):
        if field in chosen and chosen[field][1] is replacement:
            continue                                # the same part twice (a Parts resolved before)
        if field in chosen:
            raise ValueError(f"{chosen[field][0]} and {who} both replace Parts.{field}: use one at a time")
        chosen[field] = (who, replacement)
    return _hand_exchange(dataclasses.replace(Parts(), **{f: r for f, (_, r) in chosen.items()}))


def _swaps(names, catalogue: dict, mine: dict) -> list[tuple[str, str, object]]:
    """``(who, field, replacement)`` for each field the named bugs, then ``mine``, replace."""
    return ([(f"bug {n!r}", f, r) for n in names for f, r in catalogue[n].items()]
            + [(f"your part {_describe(r)}", f, r) for f, r in mine.items()])


# The fields an engine uses only under some settings. A bug or a part that replaces one in an engine without its
# setting changes nothing: HF's tokens would then call a pitfall harmless, or a learner's part right, unseen.
USED_ONLY_WITH = {"sp_norm_region": "sequence_parallel=True at tensor_parallel_size > 1",
                  "pipeline_stage": "pipeline_parallel_size > 1 (one stage holds every layer and sends nothing)",
                  "static_decode": "decode steps at fixed shapes (static_decode=True, or CUDA graphs on a GPU)",
                  "experts": "a mixture-of-experts checkpoint",
                  "moe_dispatch": "a mixture-of-experts checkpoint at data_parallel_size > 1",
                  "moe_combine": "a mixture-of-experts checkpoint at data_parallel_size > 1"}


def refuse_unused(bugs, parts, used: dict[str, bool]) -> None:
    """Raise if a bug in ``bugs`` or a part in ``parts`` (as ``resolve`` takes them) replaces a field of
    ``USED_ONLY_WITH`` that this engine does not use (``used[field]`` False), saying which setting it needs."""
    names = bug_names(bugs)
    mine = parts.replaced() if isinstance(parts, Parts) else dict(parts or {})
    for who, field, _ in _swaps(names, known_bugs() if names else {}, mine):
        if field in USED_ONLY_WITH and not used[field]:
            kind = "bug" if who.startswith("bug") else "part"
            raise ValueError(f"{who} replaces Parts.{field}, which this engine never uses: it runs only with "
                             f"{USED_ONLY_WITH[field]}. Add that, or drop the {kind}")


def _hand_exchange(parts: Parts) -> Parts:
    """``parts`` with a replaced ``moe_dispatch`` / ``moe_combine`` handed to the experts class that calls them:
    ``experts`` becomes ``functools.partial(experts, dispatch=..., combine=...)`` (from the class itself where a
    ``Parts`` resolved before is resolved again)."""
    default = Parts()
    if parts.moe_dispatch is default.moe_dispatch and parts.moe_combine is default.moe_combine:
        return parts
    experts = parts.experts.func if isinstance(parts.experts, functools.partial) else parts.experts
    if not (isinstance(experts, type) and issubclass(experts, FusedMoE)):
        raise ValueError(f"Parts.moe_dispatch and Parts.moe_combine are called by tplab's FusedMoE (its dispatch= "
                         f"and combine=); the experts part {_describe(experts)} is not one: replace one or the other")
    return dataclasses.replace(parts, experts=functools.partial(experts, dispatch=parts.moe_dispatch,
                                                                combine=parts.moe_combine))


def for_device(parts: Parts, device, dtype: torch.dtype, head_dim: int) -> Parts:
    """``parts``, with tplab's own ``Attention`` / ``Gemm`` / ``FusedMoE`` in place of a kernel part that says it
    cannot run on ``device`` in ``dtype`` (its ``cannot_run``; one line on stderr says why). Decided once, in the
    process that creates the ``LLM``, so that every rank builds the same."""
    device = torch.device(device)
    asks = {"attention": (Attention, lambda part: part.cannot_run(device, dtype, head_dim)),
            "gemm": (Gemm, lambda part: part.cannot_run(device, dtype)),
            "experts": (FusedMoE, lambda part: part.cannot_run(device, dtype))}
    own = {}
    for name, (base, cannot_run) in asks.items():
        part = getattr(parts, name)
        why = cannot_run(part) if isinstance(part, type) and issubclass(part, base) else None
        if why is not None:
            _say_once(f"tplab: {part.__name__} runs as tplab's {base.__name__} here: {why}")
            own[name] = base
    return dataclasses.replace(parts, **own) if own else parts


@functools.cache
def _say_once(line: str) -> None:
    print(line, file=sys.stderr)
