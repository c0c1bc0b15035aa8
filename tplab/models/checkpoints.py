"""Checkpoints the workbook can use with no download: random Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE models of
any shape, and the shipped tiny models trained on generated stories (dense Qwen2 and Qwen3-MoE). A random
checkpoint's settings are checked before it is written: a misspelt field, or an attention no model can build."""
import difflib
from pathlib import Path

import torch

from tplab.models.registry import check_shape

SMALL_QWEN2 = dict(  # small enough for many tests; GQA with 2 query heads per KV head
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, initializer_range=0.2, use_sliding_window=False,
)


SMALL_QWEN3 = dict(SMALL_QWEN2, head_dim=32)   # head_dim from the config, not hidden_size / heads (16)
SMALL_MOE = dict(  # 8 experts of 32, 2 per token; untied, as the Hub's MoE models are
    SMALL_QWEN2, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    tie_word_embeddings=False,
)
SMALL_QWEN2_MOE = dict(SMALL_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False)   # Qwen1.5-MoE's
SMALL_QWEN3_MOE = dict(SMALL_MOE, head_dim=32, norm_topk_prob=True)                           # Qwen3-30B-A3B's


def save_random_qwen2(out_dir, seed: int = 0, **overrides) -> Path:
    """Write a randomly initialised HF Qwen2 checkpoint (config.json, model.safetensors) to ``out_dir``.

    ``overrides`` are ``Qwen2Config`` fields. Every parameter is random, q/k/v biases and
    RMSNorm weights included (HF would leave them 0 and 1, which would hide a bug in
    loading them), and weights have std ``initializer_range`` (0.2 by default) so that
    greedy choices are clear-cut rather than near ties.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _save_random(Qwen2Config, Qwen2ForCausalLM, {**SMALL_QWEN2, **overrides}, out_dir, seed)


def save_random_qwen3(out_dir, seed: int = 0, **overrides) -> Path:
    """``save_random_qwen2`` for Qwen3 (dense): ``overrides`` are ``Qwen3Config`` fields (``head_dim``,
    ``attention_bias``, ...); the per-head ``q_norm``/``k_norm`` weights are random too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _save_random(Qwen3Config, Qwen3ForCausalLM, {**SMALL_QWEN3, **overrides}, out_dir, seed)


def save_random_qwen2_moe(out_dir, seed: int = 0, **overrides) -> Path:
    """``save_random_qwen2`` for Qwen2-MoE: ``overrides`` are ``Qwen2MoeConfig`` fields (``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``, ...). The file names each expert's tensors
    (``model.layers.0.mlp.experts.3.gate_proj.weight``), as the Hub's files do."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _save_random(Qwen2MoeConfig, Qwen2MoeForCausalLM, {**SMALL_QWEN2_MOE, **overrides}, out_dir, seed)


def save_random_qwen3_moe(out_dir, seed: int = 0, **overrides) -> Path:
    """``save_random_qwen2_moe`` for Qwen3-MoE (Qwen3's attention, no shared expert): ``Qwen3MoeConfig`` fields."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return _save_random(Qwen3MoeConfig, Qwen3MoeForCausalLM, {**SMALL_QWEN3_MOE, **overrides}, out_dir, seed)


def _save_random(config_class, model_class, settings: dict, out_dir, seed: int) -> Path:
    """Build HF's ``model_class`` from ``settings``, make every parameter random, and ``save_pretrained`` it
    (transformers 5 holds an MoE layer's experts stacked in memory and writes them one tensor per expert)."""
    _check_fields(config_class, settings)
    if "rope_theta" in settings:  # transformers 5 keeps it in rope_parameters
        settings.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": settings.pop("rope_theta")})
    config = config_class(**settings)
    check_shape(config)
    torch.manual_seed(seed)
    model = model_class(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else config.initializer_range * noise)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _check_fields(config_class, settings: dict) -> None:
    """Refuse a key that is no field of ``config_class``: HF would store it in config.json and build the model
    without it (``num_layers=6`` gives the default 2 layers). Also taken: ``rope_theta`` (``_save_random`` moves
    it into ``rope_parameters``) and ``head_dim`` (HF's attention of every Qwen reads it, declared or not)."""
    fields = {k for k in config_class().to_dict() if not k.startswith("_")}
    known = fields | set(config_class.attribute_map) | {"rope_theta", "head_dim"}
    for key in settings:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f": did you mean {near[0]!r}?" if near else f"; its fields are {sorted(known)}"
            raise ValueError(f"unknown {config_class.__name__} field {key!r}{hint}")


def tiny_stories() -> Path:
    """The shipped tiny Qwen2 trained on generated short stories (HF folder with tokenizer)."""
    return _shipped("tiny_stories")


def tiny_moe() -> Path:
    """The shipped tiny Qwen3-MoE (8 experts, top 2) trained on the same stories, with the same tokenizer."""
    return _shipped("tiny_moe")


def _shipped(name: str) -> Path:
    path = Path(__file__).parent / name
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped model is missing from {path}; retrain it with "
                                f"scripts/{name}/train.py (see the README)")
    return path
