"""How big one rank's paged KV cache is: its layout (``kv_cache_spec``), the memory it may take
(``kv_cache_budget``, less the CUDA graphs' pool) and the blocks that makes (``kv_blocks_per_batch``), the same
on every rank.
"""
import psutil
import torch
import torch.distributed as dist

from tplab.distributed.parallel_state import cdiv
from tplab.engine.config import EngineConfig
from tplab.engine.model_runner import KVCacheSpec
from tplab.engine.static_decode import MAX_CONTEXT, graph_memory_bound
from tplab.layers.attention import cache_shape_of
from tplab.models.qwen2 import head_dim_of, local_head_counts


def kv_cache_spec(cfg: EngineConfig, num_layers: int | None = None) -> KVCacheSpec:
    """One rank's KV cache layout, from the config and the attention part's ``kv_cache_shape``, for
    ``num_layers`` layers (default: all; a pipeline stage: those it keeps a cache for)."""
    hf = cfg.hf_config
    heads, kv_heads = local_head_counts(hf, cfg.tensor_parallel_size)
    block_shape = cache_shape_of(cfg.parts.attention, 1, cfg.block_size, heads, kv_heads, head_dim_of(hf))[1:]
    return KVCacheSpec(num_layers or hf.num_hidden_layers, cfg.block_size, block_shape, cfg.dtype)


def kv_cache_budget(device: torch.device, num_ranks: int) -> int:
    """Default bytes for one rank's KV cache: on a GPU 90% of the memory still free after the weights (vLLM
    instead takes ``gpu_memory_utilization`` of the total, less weights, activations and graphs); on CPU a
    tenth of the available RAM shared by the ranks (that RAM also holds the notebook, the browser and every
    rank's weights), at most 4 GiB per rank (more than the few sequences a CPU serves at once can fill)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return min(psutil.virtual_memory().available // 10 // num_ranks, 4 << 30)


def kv_blocks_per_batch(cfg: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """Blocks for each batch in flight on this rank (one batch, or one per pipeline stage, each with its own
    share), the same on every rank: ``num_kv_blocks`` split over them where it is set; else what the memory
    budget holds, never more than ``max_num_seqs`` sequences of ``max_position_embeddings`` tokens can use,
    and the smallest count of any rank."""
    pp = cfg.pipeline_parallel_size
    if cfg.num_kv_blocks is not None:       # at least pp: engine.config checks
        _check_free(cfg.num_kv_blocks * spec.bytes_per_block(), device, f"num_kv_blocks={cfg.num_kv_blocks}")
        return cfg.num_kv_blocks // pp
    budget = cfg.kv_cache_memory or kv_cache_budget(device, cfg.world_size)
    if cfg.cuda_graphs and cfg.kv_cache_memory is None:        # the graphs' pool comes out of the same memory
        budget -= graph_memory_for(cfg)
    budget //= pp
    useful = cfg.max_num_seqs * cdiv(cfg.hf_config.max_position_embeddings, cfg.block_size)
    blocks = torch.tensor(min(budget // spec.bytes_per_block(), useful), device=device)  # NCCL takes CUDA tensors only
    if cfg.kv_cache_memory is not None:
        _check_free(int(blocks) * pp * spec.bytes_per_block(), device, f"kv_cache_memory={cfg.kv_cache_memory:,}")
    if dist.is_initialized():  # ranks must agree, or their schedulers would diverge
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    if blocks < 1:
        raise ValueError(f"a KV cache budget of {budget} bytes holds no block of {cfg.block_size} tokens; "
                         "raise kv_cache_memory or lower block_size")
    return int(blocks)


def _check_free(nbytes: int, device: torch.device, setting: str) -> None:
    """Refuse a KV cache the device's free memory cannot hold: zero-filling it would end in the out-of-memory
    killer (a lost notebook kernel) or CUDA's error, not in a message. Every rank refuses if one must: a rank
    that went on alone would wait for the others in its first collective."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    least_free = torch.tensor(free, device=device)                   # NCCL takes CUDA tensors only
    if dist.is_initialized():
        dist.all_reduce(least_free, op=dist.ReduceOp.MIN)
    if nbytes > int(least_free):
        where = "" if int(least_free) == free else f" of a rank (this one has {free:,})"
        raise ValueError(f"{setting} makes a KV cache of {nbytes:,} bytes on each rank, more than the "
                         f"{int(least_free):,} free{where}: ask for less, or leave num_kv_blocks and kv_cache_memory "
                         "unset to size the cache from the free memory")


def static_max_blocks(cfg: EngineConfig) -> int:
    """The widest block table a decode step at fixed shapes takes: the model's length, at most ``MAX_CONTEXT``."""
    return cdiv(min(cfg.hf_config.max_position_embeddings, MAX_CONTEXT), cfg.block_size)


def graph_memory_for(cfg: EngineConfig) -> int:
    """``static_decode.graph_memory_bound`` for this rank's shard of the model."""
    hf = cfg.hf_config
    heads, kv_heads = local_head_counts(hf, cfg.tensor_parallel_size)
    return graph_memory_bound(cfg.max_num_seqs, static_max_blocks(cfg), cfg.block_size,
                              hf.hidden_size, hf.intermediate_size // cfg.tensor_parallel_size, heads, kv_heads,
                              head_dim_of(hf), cfg.dtype)
