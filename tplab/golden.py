"""Golden checks: HF's own model's activations (Qwen2, Qwen3 and their MoE twins), captured with forward hooks,
against tplab's.

Both models use HF's module names (``model.layers.3.self_attn`` ...), so one list of
names addresses both. Activations are taken for one prompt in one prefill, as
``(T, E)`` tensors (logits ``(T, vocab)``); at TP > 1 tplab's come from rank 0,
after the all-reduces, so they are full-width and comparable with HF's (under sequence parallelism
after gathering every rank's tokens and summing the partial sums, ``all_tokens``). How close is close enough is
``tplab.tolerance``'s: relative to each activation's size and the dtype's rounding.
"""
from dataclasses import dataclass
from numbers import Integral

import torch

from tplab.distributed.launcher import launch, rank_device
from tplab.engine.probe import capture, load_model, probe
from tplab.models.registry import check_tp_size, load_model_config
from tplab import tolerance
from tplab.tolerance import bound, logprob_bound  # noqa: F401  (what notebooks call)

SUBLAYERS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def activation_names(num_layers: int) -> list[str]:
    """Embedding, each sublayer and layer output in order, final norm, logits."""
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{s}" for s in SUBLAYERS] + [f"model.layers.{i}"]
    return names + ["model.norm", "logits"]


def require_float32_matmuls() -> None:
    """Refuse to take a reference while fp32 matrix products may round their inputs (tf32, bf16).

    ``torch.set_float32_matmul_precision("medium")`` (or ``"high"``, or the backends' ``fp32_precision``)
    makes oneDNN multiply fp32 in bf16 on a CPU with AMX (and CUDA in tf32): HF's reference and tplab then
    round the same way and agree to the last bit, so a per-sublayer diff against that reference shows
    nothing while both are far from the fp32 answer (docs/numerics.md says how far)."""
    matmul = {name: getattr(getattr(torch.backends, name), "matmul", None) for name in ("mkldnn", "cuda")}
    if hasattr(matmul["mkldnn"], "fp32_precision"):              # torch >= 2.9: each backend says its own
        set_to = {name: getattr(m, "fp32_precision", "none") for name, m in matmul.items()}
    else:                                                          # older torch: one setting for every backend
        set_to = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    rounded = {name: value for name, value in set_to.items() if value not in ("none", "ieee", "highest")}
    if rounded:
        raise RuntimeError(
            f"fp32 matmuls are set to round their inputs ({', '.join(f'{k}: {v}' for k, v in rounded.items())}), "
            "so HF's reference is not fp32 and tplab would round the same way: a diff against it cannot see "
            "a bug. Run torch.set_float32_matmul_precision('highest') before comparing.")


def _check_ids(input_ids, vocab_size: int) -> list[int]:
    """``input_ids`` as a list of ints (a list, or a 1-D integer tensor), refused here with what to pass rather
    than deep inside torch: a string, an empty or nested list, or an id the embedding has no row for."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 and not input_ids.is_floating_point():
        input_ids = input_ids.tolist()
    ok = isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and all(
        isinstance(i, Integral) and not isinstance(i, bool) and 0 <= i < vocab_size for i in input_ids)
    if not ok:
        got = repr(input_ids) if len(repr(input_ids)) < 60 else f"{repr(input_ids)[:57]}..."
        raise ValueError(f"input_ids must be a non-empty list of ints in [0, {vocab_size}) (vocab_size), got {got}; "
                         "tokenize a string first (llm.tokenizer.encode), one prompt at a time")
    return [int(i) for i in input_ids]


def hf_activations(model_or_dir, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """HF's own model's activations (fp32 on CPU, HF's default attention) for one prompt: ``Qwen2ForCausalLM``,
    or the class for the checkpoint's ``model_type`` (Qwen3, Qwen2-MoE, Qwen3-MoE: ``AutoModelForCausalLM``).
    Refused while fp32 matmuls may round (``require_float32_matmuls``)."""
    from transformers import AutoModelForCausalLM
    require_float32_matmuls()
    model = model_or_dir if isinstance(model_or_dir, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    input_ids = _check_ids(input_ids, model.config.vocab_size)
    names = activation_names(model.config.num_hidden_layers)
    with torch.no_grad(), capture(model, outputs_of=names[:-1]) as (acts, _):
        logits = model(torch.tensor([input_ids])).logits[0]
    return {**acts, "logits": logits.float()}


def hf_greedy_tokens(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """HF's own ``generate``: exactly ``num_tokens`` greedy tokens after each prompt, one prompt at a time."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]


def rank_activations(model_dir, input_ids: list[int], tensor_parallel_size: int = 1, bugs=(), parts=None,
                     dtype: str = "float32", sequence_parallel: bool = False) -> dict[str, torch.Tensor] | None:
    """Inside a rank (or in-process at TP 1): build this rank's shard, prefill ``input_ids`` once with
    hooks, and return the activations on rank 0 (None elsewhere). For ranks that already exist, e.g.
    ``RankGroup.run(golden.rank_activations, (model_dir, ids, 2))``. Under ``sequence_parallel`` every
    activation is first brought back to all T tokens, summed where it is a partial sum (``all_tokens``)."""
    model = load_model(model_dir, tensor_parallel_size, bugs=bugs, parts=parts, dtype=dtype,
                       device=rank_device(), sequence_parallel=sequence_parallel)
    out = probe(model, input_ids, outputs_of=activation_names(len(model.model.layers))[:-1])
    acts = {**out.outputs, "logits": out.logits.float().cpu()}
    if model.sequence_parallel:
        acts = all_tokens(model, acts, len(input_ids))
    return acts if model.tp_rank == 0 else None


def all_tokens(model, acts: dict[str, torch.Tensor], num_tokens: int) -> dict[str, torch.Tensor]:
    """One SP rank's activations -> what plain TP's rank 0 holds (a collective: every rank calls it). Under
    SP a rank's hooks see its own ceil(T / t) tokens of the residual stream and the norms (all-gathered here,
    padding dropped), and the partial sums of o_proj, down_proj and a ReturnsPartialSums embedding (summed)."""
    from tplab.distributed.parallel_state import all_gather, all_reduce
    partial = {"self_attn", "mlp"} | ({"embed_tokens"} if model.model.embed_partial else set())
    out = {}
    for name, a in acts.items():
        if name.split(".")[-1] in partial:
            out[name] = all_reduce(a.clone(), model.tp_size)                                   # (T, E)
        elif a.shape[0] != num_tokens:                                   # this rank's tokens: (ceil(T/t), E)
            out[name] = all_gather(a.contiguous(), model.tp_size, dim=0)[:num_tokens]          # -> (T, E)
        else:
            out[name] = a                                                # whole already (the logits)
    return out


def tplab_activations(model_dir, input_ids: list[int], tensor_parallel_size: int = 1, bugs=(), parts=None,
                      dtype: str = "float32", sequence_parallel: bool = False) -> dict[str, torch.Tensor]:
    """tplab's activations for one prompt, built with ``bugs``/``parts`` swapped in; ranks spawned at TP > 1.
    With ``sequence_parallel`` each is gathered back to all T tokens, comparable with HF's. The ids and the TP
    size are checked against the checkpoint's config here, before any rank starts."""
    config = load_model_config(model_dir)
    input_ids = _check_ids(input_ids, config.vocab_size)
    check_tp_size(config, tensor_parallel_size)
    args = (str(model_dir), input_ids, tensor_parallel_size, tuple(bugs), parts, dtype, sequence_parallel)
    if tensor_parallel_size == 1:
        return rank_activations(*args)
    return launch(rank_activations, tensor_parallel_size, args=args)[0]


def stage_activations(cfg, input_ids: list[int]) -> dict[str, torch.Tensor] | None:
    """In a rank of an engine ``cfg`` (an ``EngineConfig``; pipeline parallel or not): one prefill of ``input_ids``
    through the engine itself, with hooks on the sublayers this rank's stage owns; on each stage's TP rank 0
    (after the all-reduces) ``{name: (T, E)}``, None on the other ranks."""
    from tplab.engine.sampling import SamplingParams
    from tplab.engine.worker import Worker
    from tplab.models.pipeline import PPMissingLayer
    worker = Worker(cfg)
    model = worker.engine.model
    modules = dict(model.named_modules())
    owned = [n for n in activation_names(cfg.hf_config.num_hidden_layers)[:-1]
             if n in modules and not isinstance(modules[n], PPMissingLayer)]
    with capture(model, outputs_of=owned) as (acts, _):
        worker.generate([list(input_ids)], [SamplingParams(temperature=0.0, max_tokens=1)])
    return dict(acts) if model.tp_rank == 0 else None


def pipeline_activations(model_dir, input_ids: list[int], tensor_parallel_size: int = 1, pipeline_parallel_size: int = 2,
                         bugs=(), parts=None) -> dict[str, torch.Tensor]:
    """Every sublayer's activations for one prompt through a pipeline-parallel engine (t x p ranks), each from
    the stage that owns it, in forward order; no ``logits`` (the engine computes only the last token's).
    Compare with ``compare({n: ref[n] for n in mine}, mine)``."""
    from tplab.engine.config import engine_config
    # a step's budget of at least the prompt: one unchunked prefill, so every hook sees all T tokens
    cfg = engine_config(model_dir, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                        bugs=tuple(bugs), parts=parts, max_num_batched_tokens=max(len(input_ids), 16), device="cpu")
    merged = {}
    for acts in launch(stage_activations, tensor_parallel_size * pipeline_parallel_size, args=(cfg, list(input_ids))):
        merged.update(acts or {})
    order = activation_names(cfg.hf_config.num_hidden_layers)
    return {n: merged[n] for n in order if n in merged}


@dataclass
class Diff:
    name: str
    max_abs: float      # max |mine - ref|; inf when mine has NaN or inf
    nonfinite: int      # entries of mine that are NaN or inf
    bound: float = 0.0  # how far mine may be from ref: tolerance.bound(ref), relative to ref's size

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.bound   # NaN and inf never are

    @property
    def share(self) -> float:
        """``max_abs / bound``: at most 1 when ok; inf for any difference where the bound is 0 (an all-zero ref)."""
        if self.bound:
            return self.max_abs / self.bound
        return 0.0 if self.max_abs == 0 else float("inf")

    def line(self) -> str:
        extra = f" | {self.nonfinite} non-finite" if self.nonfinite else ""
        return f"{self.name:<40} | max_abs {self.max_abs:.1e} | bound {self.bound:.0e}{extra} | {'ok' if self.ok else 'DIFF'}"


def compare(ref: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], dtype=torch.float32) -> list[Diff]:
    """Per activation name (in ``ref``'s order), the max abs difference of ``mine`` from ``ref``, and the
    bound it must keep (``tolerance.bound``: relative to that activation's size and ``dtype``'s rounding)."""
    rows = []
    for name, r in ref.items():
        m = mine[name]
        if m.shape != r.shape:
            raise ValueError(f"{name}: shapes differ, mine {tuple(m.shape)} vs reference {tuple(r.shape)}")
        nonfinite = int((~torch.isfinite(m)).sum())
        rows.append(Diff(name, tolerance.max_abs(m, r), nonfinite, tolerance.bound(r, dtype)))
    return rows


def report(rows: list[Diff]) -> bool:
    """Print one cmp-style line per activation; True when every one is within its bound."""
    for row in rows:
        print(row.line())
    return all(row.ok for row in rows)


def cmp(name: str, mine: torch.Tensor, ref: torch.Tensor, dtype=torch.float32, exact: bool = False) -> bool:
    """Karpathy-style one-line check: ``name | max_abs | bound | ok``; True when ``mine`` is within
    ``tolerance.bound(ref)`` of ``ref`` (bitwise equal with ``exact=True``, for what is exact on every
    machine: a lookup, a copy, the same ops in the same order)."""
    if mine.shape != ref.shape:
        print(f"{name} | shapes differ: {tuple(mine.shape)} vs {tuple(ref.shape)} | DIFF")
        return False
    diff = tolerance.max_abs(mine, ref)
    limit = 0.0 if exact else tolerance.bound(ref, dtype)
    ok = diff <= limit
    print(f"{name} | max_abs {diff:.1e} | bound {limit:.0e} | {'ok' if ok else 'DIFF'}")
    return ok


def first_divergence(rows: list[Diff]) -> str | None:
    """The first activation (in forward order) that is further from the reference than its bound."""
    return next((r.name for r in rows if not r.ok), None)


def worst(rows: list[Diff]) -> float:
    """The largest ``max_abs / bound`` over ``rows``: at most 1 when every activation is within its bound."""
    return max(r.share for r in rows)
