"""Which model class serves a checkpoint: its config's ``model_type`` -> the class (vLLM's model registry).

Every class takes the same arguments (``Qwen2ForCausalLM``'s) and says which of the config's sizes tensor
parallelism splits (``tp_split_sizes``); ``check_tp_size`` holds a TP size (and ``enable_expert_parallel``)
against them before any rank starts, and names the sizes that work; ``check_dp_size`` a data-parallel size.
``load_model_config`` reads a checkpoint's config after checking it is one of these, with an attention that can be
built (``check_shape``).
"""
import json
from pathlib import Path

from tplab.layers.linear import check_heads_divisible, valid_tp_sizes
from tplab.layers.rotary import check_rope_supported
from tplab.models.loader import checkpoint_files
from tplab.models.qwen2 import Qwen2ForCausalLM
from tplab.models.qwen3 import Qwen3ForCausalLM
from tplab.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, is_moe_layer

MODELS = {
    "qwen2": Qwen2ForCausalLM,         # Qwen2, Qwen2.5
    "qwen3": Qwen3ForCausalLM,         # Qwen3 dense: per-head q/k RMSNorm
    "qwen2_moe": Qwen2MoeForCausalLM,  # Qwen1.5-MoE, Qwen2-57B-A14B: experts and a gated shared expert
    "qwen3_moe": Qwen3MoeForCausalLM,  # Qwen3-30B-A3B, Qwen3-235B-A22B: experts only
}


def supported() -> str:
    return ", ".join(repr(t) for t in MODELS)


def model_class(model_type: str) -> type:
    """The class for ``model_type``, or a ValueError that lists the ones tplab serves."""
    if model_type not in MODELS:
        raise ValueError(f"model_type={model_type!r} is not served by tplab; it serves {supported()}")
    return MODELS[model_type]


def load_model_config(model_dir):
    """The checkpoint's HF config (``Qwen2Config``, ``Qwen3Config``, ``Qwen2MoeConfig`` or ``Qwen3MoeConfig``),
    after checking the folder holds a safetensors checkpoint of a ``model_type`` tplab serves (``MODELS``)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    checkpoint_files(model_dir)  # folder exists and has safetensors
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not valid JSON ({e}): fix the file, or write it again with "
                         "config.save_pretrained(folder)") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODELS:
        raise ValueError(f"{config_file} has model_type={model_type!r}; tplab runs Qwen2, Qwen3, Qwen2-MoE and "
                         f"Qwen3-MoE checkpoints (model_type {supported()}, e.g. Qwen2.5-0.5B-Instruct, Qwen3-0.6B, "
                         "Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B): pass the folder of one of those")
    config = AutoConfig.from_pretrained(model_dir)
    check_shape(config, f"{config_file}: ")
    check_rope_supported(config)
    if getattr(config, "use_sliding_window", False):
        raise NotImplementedError("use_sliding_window=True is not implemented in tplab; set it to false")
    return config


def check_shape(config, where: str = "") -> None:
    """Refuse a config whose attention cannot be built (HF's own model fails on it too): query heads that do not
    split into whole groups per KV head, an odd head_dim (RoPE rotates pairs), or, without an explicit head_dim,
    a hidden_size that is not num_attention_heads x head_dim. ``where`` says which file, if any."""
    heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None)           # Qwen3's is explicit and need not be hidden / heads
    if heads < 1 or kv < 1 or heads % kv:
        fix = (f"num_key_value_heads to one of {[d for d in range(1, heads + 1) if heads % d == 0]}" if heads >= 1
               else "num_attention_heads to 1 or more")
        raise ValueError(f"{where}num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} (each KV "
                         f"head serves a group of whole query heads): set {fix}")
    step = 2 * heads                                       # heads x an even head_dim
    if head_dim is None and hidden % step:
        near = " or ".join(str(h) for h in (hidden - hidden % step, hidden - hidden % step + step) if h > 0)
        raise ValueError(f"{where}hidden_size={hidden} is not num_attention_heads={heads} x an even head_dim (RoPE "
                         f"rotates pairs of dimensions): set hidden_size to a multiple of {step} ({near}), or set "
                         "head_dim explicitly")
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        raise ValueError(f"{where}head_dim={head_dim} is not a positive even number, and RoPE rotates pairs of "
                         "dimensions: set an even head_dim")


def check_tp_size(config, tp_size: int, enable_expert_parallel: bool = False) -> None:
    """A TP size must split the query heads, the KV heads (or replicate them) and the sizes the model class
    splits (``tp_split_sizes``: the MLPs' intermediate sizes; with ``enable_expert_parallel``, the experts)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool):
        raise ValueError(f"tensor_parallel_size must be an int, got {tp_size!r}")
    cls = model_class(config.model_type)
    split = cls.tp_split_sizes(config, enable_expert_parallel)
    check_heads_divisible(config.num_attention_heads, config.num_key_value_heads, tp_size, *split.values())
    bad = [(name, size) for name, size in split.items() if size % tp_size]
    if not bad:
        return
    name, size = bad[0]
    sizes = valid_tp_sizes(config.num_attention_heads, config.num_key_value_heads, *split.values())
    why = f"{name} {size} is not divisible by {tp_size}"
    if name == "num_experts":                 # expert parallelism: whole experts on each rank
        why = (f"enable_expert_parallel=True places whole experts on the {tp_size} ranks, and the {size} experts "
               f"(num_experts) do not divide by {tp_size}")
        plain = valid_tp_sizes(config.num_attention_heads, config.num_key_value_heads,
                               *cls.tp_split_sizes(config, False).values())
        if tp_size in plain:
            sizes = f"{sizes}; or drop enable_expert_parallel (each expert is then split over the {tp_size} ranks)"
    elif has_experts(config) and tp_size in valid_tp_sizes(config.num_attention_heads, config.num_key_value_heads,
                                                           *cls.tp_split_sizes(config, True).values()):
        sizes = f"{sizes}; or enable_expert_parallel=True (whole experts on each rank: none is split)"
    raise ValueError(f"tensor_parallel_size={tp_size} does not work: {why}. TP sizes that work: {sizes}")


def has_experts(config) -> bool:
    """Whether the checkpoint's model has MoE layers (an MoE model type with at least one sparse layer)."""
    return (issubclass(model_class(config.model_type), Qwen2MoeForCausalLM)
            and any(is_moe_layer(config, i) for i in range(config.num_hidden_layers)))


def steps_in_lockstep(config, dp_size: int) -> bool:
    """Whether data-parallel ranks must step together: their forward passes exchange tokens (the experts are
    spread over all of them). A dense model's DP ranks are replicas that never talk."""
    return dp_size > 1 and has_experts(config)


def check_dp_size(config, dp_size: int, tp_size: int, enable_expert_parallel: bool) -> None:
    """``data_parallel_size`` d: a dense model runs d replicas; an MoE model serves attention data-parallel with
    its experts spread over all ``d x tensor_parallel_size`` ranks, which needs ``enable_expert_parallel`` and
    ``num_experts`` divisible by ``d x t``."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {dp_size!r}")
    if dp_size == 1 or not has_experts(config):
        return
    experts, ranks = config.num_experts, dp_size * tp_size
    if not enable_expert_parallel:
        raise ValueError(f"data_parallel_size={dp_size} on an MoE model ({experts} experts) spreads the experts over "
                         f"all {dp_size} x {tp_size} = {ranks} ranks, which tplab does by expert parallelism only: "
                         "pass enable_expert_parallel=True (or data_parallel_size=1; vLLM can also split each "
                         "expert over the ranks, tplab does not)")
    if experts % ranks:
        sizes = [d for d in range(1, experts + 1) if experts % (d * tp_size) == 0]
        fix = (f"with tensor_parallel_size={tp_size} use data_parallel_size in {sizes}" if sizes else
               f"no data_parallel_size works with tensor_parallel_size={tp_size}: use one that divides {experts}")
        raise ValueError(f"data_parallel_size={dp_size} x tensor_parallel_size={tp_size} = {ranks} ranks share the "
                         f"experts whole, and the {experts} experts (num_experts) do not divide by {ranks}: {fix}")
