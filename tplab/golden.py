"""Golden checks: HF Qwen2's own activations, captured with forward hooks, against tplab's.

Both models use HF's module names (``model.layers.3.self_attn`` ...), so one list of
names addresses both. Activations are taken for one prompt in one prefill, as
``(T, E)`` tensors (logits ``(T, vocab)``); at TP > 1 tplab's come from rank 0,
after the all-reduces, so they are full-width and comparable with HF's.
"""
from dataclasses import dataclass

import torch

SUBLAYERS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def activation_names(num_layers: int) -> list[str]:
    """Embedding, each sublayer and layer output in order, final norm, logits."""
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{s}" for s in SUBLAYERS] + [f"model.layers.{i}"]
    return names + ["model.norm", "logits"]


def _capture(model, names, forward) -> dict[str, torch.Tensor]:
    """Run ``forward()`` with hooks on ``names``; returns each module's output as a 2-D float tensor."""
    acts, modules, hooks = {}, dict(model.named_modules()), []
    for name in names:
        if name in modules:
            def hook(_, __, out, name=name):
                out = out[0] if isinstance(out, tuple) else out
                acts[name] = out.detach().float().reshape(-1, out.shape[-1]).cpu()
            hooks.append(modules[name].register_forward_hook(hook))
    try:
        acts["logits"] = forward().detach().float().reshape(-1, model.config.vocab_size).cpu()
    finally:
        for h in hooks:
            h.remove()
    return acts


def hf_activations(model_or_dir, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """HF ``Qwen2ForCausalLM``'s activations (fp32 on CPU, HF's default attention) for one prompt."""
    from transformers import Qwen2ForCausalLM
    model = model_or_dir if isinstance(model_or_dir, torch.nn.Module) else \
        Qwen2ForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    names = activation_names(model.config.num_hidden_layers)
    with torch.no_grad():
        return _capture(model, names, lambda: model(torch.tensor([input_ids])).logits)


def rank_activations(cfg, input_ids):
    """Inside a rank (or in-process at TP 1): build this rank's shard from ``cfg`` (an ``EngineConfig``),
    prefill ``input_ids`` once with hooks, and return the activations on rank 0 (None elsewhere).
    For ranks that already exist, e.g. ``RankGroup.run(golden.rank_activations, (cfg, ids))``."""
    from tplab.dist import rank_device
    from tplab.engine.engine import build_model
    from tplab.engine.runner import ModelRunner
    from tplab.engine.sampling import SamplingParams
    from tplab.engine.sequence import Sequence
    from tplab.layers.attention import build_metadata

    device = cfg.device or rank_device()
    model = build_model(cfg, device)
    runner = ModelRunner(model, device, cfg.torch_dtype)
    runner.allocate(1, len(input_ids))
    seq = Sequence(0, list(input_ids), len(input_ids), SamplingParams(), block_table=[0])
    meta = build_metadata([len(seq)], [len(seq)], [seq.block_table], runner.block_size, device,
                          positions=runner.positions_fn(seq))
    ids = torch.tensor(input_ids, device=device)
    with torch.inference_mode():
        acts = _capture(model, activation_names(len(model.model.layers)),
                        lambda: model.compute_logits(model(ids, runner.kv_caches, meta)))
    return acts if model.tp_rank == 0 else None


def tplab_activations(model_dir, input_ids: list[int], tensor_parallel_size: int = 1, bugs=(),
                      dtype: str = "float32") -> dict[str, torch.Tensor]:
    """tplab's activations for one prompt, built with ``bugs`` swapped in; ranks spawned at TP > 1."""
    from tplab.config import EngineConfig
    from tplab.dist import launch
    cfg = EngineConfig(str(model_dir), tensor_parallel_size, dtype, bugs=tuple(bugs), device="cpu")
    if tensor_parallel_size == 1:
        return rank_activations(cfg, input_ids)
    return launch(rank_activations, tensor_parallel_size, args=(cfg, input_ids))[0]


@dataclass
class Diff:
    name: str
    max_abs: float      # max |mine - ref|; inf when mine has NaN or inf
    nonfinite: int      # entries of mine that are NaN or inf

    def line(self, tol: float) -> str:
        verdict = "ok" if self.max_abs <= tol else "DIFF"
        extra = f" | {self.nonfinite} non-finite" if self.nonfinite else ""
        return f"{self.name:<40} | max_abs {self.max_abs:.1e}{extra} | {verdict}"


def compare(ref: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> list[Diff]:
    """Per activation name (in ``ref``'s order), the max abs difference of ``mine`` from ``ref``."""
    rows = []
    for name, r in ref.items():
        m = mine[name]
        if m.shape != r.shape:
            raise ValueError(f"{name}: shapes differ, mine {tuple(m.shape)} vs reference {tuple(r.shape)}")
        bad = int((~torch.isfinite(m)).sum())
        rows.append(Diff(name, float("inf") if bad else float((m - r).abs().max()), bad))
    return rows


def report(rows: list[Diff], tol: float = 1e-4) -> bool:
    """Print one cmp-style line per activation; True when all are within ``tol``."""
    for row in rows:
        print(row.line(tol))
    return all(row.max_abs <= tol for row in rows)


def cmp(name: str, mine: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> bool:
    """Karpathy-style one-line check: ``name | exact | allclose | max_abs | ok``; True when within ``tol``."""
    mine, ref = mine.detach().float().cpu(), ref.detach().float().cpu()
    if mine.shape != ref.shape:
        print(f"{name} | shapes differ: {tuple(mine.shape)} vs {tuple(ref.shape)} | DIFF")
        return False
    diff = (mine - ref).abs().max().item() if mine.numel() else 0.0
    exact = torch.equal(mine, ref)
    ok = diff <= tol  # NaN compares False, so a NaN never passes
    print(f"{name} | exact {exact} | max_abs {diff:.1e} | {'ok' if ok else 'DIFF'}")
    return ok


def first_divergence(rows: list[Diff], tol: float = 1e-4) -> str | None:
    """The first activation (in forward order) that differs from the reference by more than ``tol``."""
    return next((r.name for r in rows if r.max_abs > tol), None)
