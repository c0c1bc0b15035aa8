"""Checkpoint and engine settings, resolved once into a frozen ``EngineConfig`` and validated up front,
so that bad input fails with a message that says what to change, before any rank starts."""
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import torch
import torch.distributed as dist

from tplab.distributed.launcher import check_timeout, pick_backend
from tplab.engine.parts import Parts, bug_names, for_device, refuse_unused, resolve
from tplab.layers.attention import Attention
from tplab.layers.linear import returns_partial_sums
from tplab.models.qwen2 import head_dim_of
from tplab.models.registry import check_dp_size, check_tp_size, has_experts, load_model_config

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_model(model) -> Path:
    """A local checkpoint folder for ``model``: the folder itself, or a hub id such as
    ``Qwen/Qwen2.5-0.5B-Instruct`` downloaded (safetensors, config, tokenizer) where there is internet."""
    path = Path(model).expanduser()
    if path.exists() or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        return path
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise FileNotFoundError(f"{model} is not a local folder, and HF_HUB_OFFLINE is set so it cannot be "
                                "downloaded: pass the folder of a downloaded checkpoint, or set HF_HUB_OFFLINE=0")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


def check_pp_size(config, pp_size) -> None:
    """A pipeline stage owns at least one layer: ``1 <= pipeline_parallel_size <= num_hidden_layers``."""
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pp_size!r}")
    if pp_size > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is more stages than the model's {config.num_hidden_layers} "
                         f"layers (num_hidden_layers): every stage needs a layer; "
                         f"use at most {config.num_hidden_layers}")


def resolve_dtype(dtype, config) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"``/a torch dtype, or ``"auto"`` for the checkpoint's own."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return own if isinstance(own, torch.dtype) else DTYPES.get(str(own), torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def default_batched_tokens(device, hf_config) -> int:
    """Tokens per step when ``max_num_batched_tokens`` is not given: 4096 on a GPU (vLLM's default); on CPU
    512 for a dense model, whose activations then stay in the last-level cache and in memory the allocator
    reuses (measured in docs/performance-journal.md), and 2048 for a mixture of experts: a step reads the
    weights of every expert its tokens chose, all of them from a few hundred tokens on, so fewer, longer
    steps read them fewer times."""
    return 4096 if torch.device(device).type == "cuda" else 2048 if has_experts(hf_config) else 512


def env_flag(name: str, default: str = "1") -> bool:
    """A setting's default from the environment, read when a config is resolved: ``name`` set to 1, true, on or
    yes is on, to 0, false, off or no (or empty) is off; unset, ``default``."""
    value = os.environ.get(name, default).strip().lower()
    if value not in ("1", "true", "on", "yes", "0", "false", "off", "no", ""):
        raise ValueError(f"{name}={os.environ[name]!r} is neither on nor off: set it to 1 or 0, or unset it")
    return value in ("1", "true", "on", "yes")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def plain_config(hf_config):
    """The checkpoint config's numbers in a plain namespace: what the engine reads, picklable as is, and
    a rank that receives it needs no transformers import (slow: it would delay every rank's start). Fields HF
    keeps under another name (``attribute_map``: Qwen3-MoE's ``num_experts`` is ``num_local_experts``) are
    there under both."""
    if isinstance(hf_config, SimpleNamespace):
        return hf_config
    aliases = {name: getattr(hf_config, name) for name in getattr(hf_config, "attribute_map", {})}
    return SimpleNamespace(**hf_config.to_dict(), **aliases)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every setting of an engine, resolved once against the checkpoint and the machine: ``LLM(model,
    **settings)`` makes one, and every rank receives it as it is. The fields are the settings ``LLM`` and
    ``probe.load_model`` take; the comment says what each becomes.
    Bad input fails here, with a message that says what to change, before any rank starts.
    """
    model: str                         # a checkpoint folder, or a hub id -> the local folder
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1    # stages, each a contiguous range of layers on its own TP ranks
    data_parallel_size: int = 1        # DP ranks of t TP ranks, each its own requests (MoE: experts over all d t)
    dtype: torch.dtype | str = "float32"  # a name, a torch dtype or "auto" -> the torch dtype
    seed: int = 0
    bugs: tuple[str, ...] = ()         # pitfalls by name (tplab.bugs.NAMES)
    parts: Parts | dict | None = None  # a learner's own parts {field of Parts: replacement} -> with bugs, a Parts
    backend: str | None = None         # "gloo"/"nccl"; None -> nccl when there is a GPU per rank, else gloo
    timeout: float = 600.0             # seconds a rank may take for one call
    device: str | None = None          # None -> "cuda" where the ranks' backend is nccl (TP 1: a GPU), else "cpu"
    # paged KV cache and continuous batching
    block_size: int = 16               # tokens per KV block
    num_kv_blocks: int | None = None   # None: as many as kv_cache_memory allows (under PP: split by p)
    kv_cache_memory: int | None = None  # bytes per rank for the KV cache; None: kv_cache.kv_cache_budget
    max_num_seqs: int = 16             # sequences in flight per step
    max_num_batched_tokens: int | None = None  # tokens per step (a longer prompt is prefilled in chunks);
                                        # None -> default_batched_tokens(device, hf_config)
    enable_prefix_caching: bool = False
    check_finite: bool = False         # raise at the first sublayer whose output is NaN/inf
    sequence_parallel: bool = False    # TP > 1: reduce-scatter + all-gather over tokens instead of all-reduce
    enable_expert_parallel: bool = False  # MoE: each rank holds num_experts / (d t) whole experts (vLLM's name)
    # decode steps at fixed shapes (engine.static_decode), replayed as CUDA graphs on a GPU
    enforce_eager: bool = False        # True: no CUDA graphs (vLLM's name)
    static_decode: bool | None = None  # pad decode steps to a bucket; None -> True where CUDA graphs run
    # CPU speed settings; the environment gives their defaults (TPLAB_ONEDNN=0: plain F.linear)
    onednn: bool = field(default_factory=lambda: env_flag("TPLAB_ONEDNN"))      # linear through oneDNN
    pack_weights: bool = field(default_factory=lambda: env_flag("TPLAB_PACK_WEIGHTS"))  # packed for it
    few_rows_mkl: bool = field(default_factory=lambda: env_flag("TPLAB_FEW_ROWS_MKL"))  # kernels.gemm.FEW_ROWS
    malloc_tune: bool = field(default_factory=lambda: env_flag("TPLAB_MALLOC_TUNE"))    # engine.malloc
    compile: bool = field(default_factory=lambda: env_flag("TPLAB_COMPILE", "0"))  # torch.compile, engine.compiled
    hf_config: object = field(default=None, repr=False)  # None -> config.json's, as plain_config

    @property
    def world_size(self) -> int:
        """Every rank: ``data_parallel_size x pipeline_parallel_size x tensor_parallel_size``."""
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps are captured and replayed as CUDA graphs (``engine.static_decode``)."""
        return self.static_decode and torch.device(self.device).type == "cuda" and not self.enforce_eager

    def __post_init__(self):
        resolved = _resolved(self)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)      # frozen from here on


SETTINGS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("model", "hf_config"))


def _resolved(cfg: EngineConfig) -> dict:
    """The values ``cfg``'s raw settings resolve to, checked."""
    model = str(resolve_model(cfg.model))
    hf = cfg.hf_config or load_model_config(model)
    _check_settings(cfg, hf)
    bugs = bug_names(cfg.bugs)
    parts = resolve(bugs, cfg.parts)
    check_sequence_parallel(cfg.sequence_parallel, cfg.tensor_parallel_size, parts, cfg.data_parallel_size)
    backend = dist.get_backend() if dist.is_initialized() else pick_backend(cfg.world_size, cfg.backend)
    dtype, device = resolve_dtype(cfg.dtype, hf), _device(cfg, backend)
    parts = for_device(parts, device, dtype, head_dim_of(hf))
    static, moe = resolve_static_decode(cfg, parts, device, hf), has_experts(hf)
    exchange = moe and cfg.data_parallel_size > 1
    refuse_unused(bugs, cfg.parts, dict(sp_norm_region=cfg.sequence_parallel and cfg.tensor_parallel_size > 1,
                                        pipeline_stage=cfg.pipeline_parallel_size > 1, static_decode=static,
                                        experts=moe, moe_dispatch=exchange, moe_combine=exchange))
    budget = cfg.max_num_batched_tokens or default_batched_tokens(device, hf)
    return dict(model=model, dtype=dtype, hf_config=plain_config(hf), bugs=bugs, parts=parts, backend=backend,
                device=device, static_decode=static, max_num_batched_tokens=budget)


def _check_settings(cfg: EngineConfig, hf) -> None:
    """Refuse the plain settings that are wrong on their own or for the checkpoint ``hf``: flags, sizes, seed,
    timeout."""
    for name in ("enable_expert_parallel", "enable_prefix_caching", "check_finite", "compile", "enforce_eager",
                 "onednn", "pack_weights", "few_rows_mkl", "malloc_tune"):
        if not isinstance(getattr(cfg, name), bool):     # "False" would be true
            raise ValueError(f"{name} must be True or False, got {getattr(cfg, name)!r}")
    check_tp_size(hf, cfg.tensor_parallel_size, cfg.enable_expert_parallel)
    check_dp_size(hf, cfg.data_parallel_size, cfg.tensor_parallel_size, cfg.enable_expert_parallel)
    check_pp_size(hf, cfg.pipeline_parallel_size)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not -2 ** 63 <= cfg.seed < 2 ** 63:
        raise ValueError(f"seed must be an int in [-2**63, 2**63) (a torch.Generator takes it plus a prompt's "
                         f"index), got {cfg.seed!r}")
    check_timeout(cfg.timeout)
    for name in ("block_size", "max_num_seqs"):
        _positive_int(name, getattr(cfg, name))
    for name in ("num_kv_blocks", "kv_cache_memory", "max_num_batched_tokens"):
        if getattr(cfg, name) is not None:
            _positive_int(name, getattr(cfg, name))
    pp = cfg.pipeline_parallel_size
    if cfg.num_kv_blocks is not None and cfg.num_kv_blocks < pp:
        raise ValueError(f"num_kv_blocks={cfg.num_kv_blocks} is shared by the {pp} batches in flight under "
                         f"pipeline_parallel_size={pp}: give at least {pp}")


def resolve_static_decode(cfg: EngineConfig, parts: Parts, device: str, hf) -> bool:
    """Whether decode steps run at fixed shapes: by default where they are replayed as CUDA graphs (CUDA,
    not ``enforce_eager``), on request anywhere. Not with what changes a step's shapes or reads its values
    on the host: pipeline stages, sequence parallelism's token split, ``check_finite``, an MoE model's experts
    (which rows each runs depends on the routing), or an attention that does not say it takes a step at fixed
    shapes (``Attention.takes_padded_decodes``)."""
    if cfg.static_decode is not None and not isinstance(cfg.static_decode, bool):
        raise ValueError(f"static_decode must be True, False or None (on where CUDA graphs run), "
                         f"got {cfg.static_decode!r}")
    blockers = {"pipeline_parallel_size > 1": cfg.pipeline_parallel_size > 1,
                "sequence_parallel=True": cfg.sequence_parallel and cfg.tensor_parallel_size > 1,
                "check_finite=True": cfg.check_finite, "an MoE model": has_experts(hf),
                f"attention {_name(parts.attention)} with attend {_name(parts.attend)} (they do not say they "
                "take a step at fixed shapes: Attention.takes_padded_decodes)": not attends_padded(parts)}
    reasons = [why for why, blocks in blockers.items() if blocks]
    if cfg.static_decode is None:
        return torch.device(device).type == "cuda" and not cfg.enforce_eager and not reasons
    if cfg.static_decode and reasons:
        raise ValueError(f"static_decode=True cannot run with {', '.join(reasons)}: drop static_decode "
                         "(or the setting it names)")
    return cfg.static_decode


def attends_padded(parts: Parts) -> bool:
    """Whether the attention part runs a decode step at fixed shapes with the ``attend`` part (it says so)."""
    return (isinstance(parts.attention, type) and issubclass(parts.attention, Attention)
            and parts.attention.takes_padded_decodes(parts.attend))


def _name(part) -> str:
    return getattr(part, "__qualname__", None) or repr(part)    # a class or function by name, else its repr


def check_sequence_parallel(sequence_parallel, tp_size: int, parts: Parts, dp_size: int = 1) -> None:
    """Sequence parallelism reduce-scatters the row-parallel layers' partial sums, so at TP > 1 it needs a
    ``row_linear`` that says it can return them (``tplab.layers.linear.ReturnsPartialSums``); not with data
    parallelism (not composed yet)."""
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if sequence_parallel and dp_size > 1:
        raise ValueError(f"sequence_parallel=True with data_parallel_size={dp_size}: tplab does not compose them "
                         "yet; drop one")
    row = parts.row_linear
    if sequence_parallel and tp_size > 1 and not returns_partial_sums(row):
        raise ValueError(f"sequence_parallel=True needs a row_linear that returns partial sums when built with "
                         f"reduce_results=False (a subclass of tplab.layers.linear.ReturnsPartialSums); "
                         f"{row.__qualname__ if isinstance(row, type) else row!r} is not: "
                         "drop sequence_parallel or that part")


def _device(cfg: EngineConfig, backend: str) -> str:
    if cfg.device is not None:
        if not (isinstance(cfg.device, (str, torch.device)) and str(cfg.device).split(":")[0] in ("cpu", "cuda")):
            raise ValueError(f"device={cfg.device!r}: tplab runs on 'cpu' or 'cuda' (or 'cuda:N'): pass one of them, "
                             "or leave device unset")
        asked = torch.device(cfg.device)
        if asked.type == "cuda" and (asked.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device={cfg.device!r}, but this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                             "visible: pass device='cpu', or leave device unset to use a GPU where there is one")
        return str(cfg.device)
    if cfg.world_size == 1 and not dist.is_initialized():
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if "nccl" in backend else "cpu"


def engine_config(model, **settings) -> EngineConfig:
    """``EngineConfig(model=model, **settings)``, or an error that lists the settings there are."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; the settings are {list(SETTINGS)}")
    return EngineConfig(model=str(model), **settings)


def check_sendable(config) -> None:
    """Refuse, before any rank starts, settings that cannot travel to the ranks: a part pickled by value
    carries the globals it reads."""
    try:
        cloudpickle.dumps(config)
    except Exception as e:
        raise ValueError(f"the settings cannot be sent to the ranks ({type(e).__name__}: {e}): at TP > 1 each part "
                         "(parts=...) travels to every rank with the notebook globals it reads, so those must pickle "
                         "(an open file, a lock or an LLM do not): read them inside the part instead") from None
