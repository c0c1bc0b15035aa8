"""Look inside one rank's model, outside the scheduler: build it, feed one sequence through it a
step at a time, and capture what chosen modules receive and return.

Golden checks against HF, the pitfalls' demonstrations, the notebooks and the exercise checkers
all go through ``load_model`` and ``probe``; the engine serves requests with the same model, the
same attention metadata and the same KV cache layout.

    model = load_model(model_dir)                                 # this rank's shard (TP 1 here)
    out = probe(model, prompt_ids, outputs_of=["model.layers.0.self_attn"],
                max_len=len(prompt_ids) + 8)                      # a cache with room for 8 more tokens
    out.logits                                                    # (T, V)
    out.outputs["model.layers.0.self_attn"]                       # (T, E)
    nxt = probe(model, [token], cache=out.cache)                  # decode one more token
"""
import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from tplab.engine.config import EngineConfig, engine_config
from tplab.engine.llm_engine import build_model
from tplab.layers.attention import cache_shape_of
from tplab.layers.metadata import build_metadata
from tplab.models.qwen2 import head_dim_of, local_head_counts


def load_model(model, tensor_parallel_size: int = 1, *, tp_rank: int | None = None, device="cpu", **settings):
    """This rank's shard of the checkpoint folder ``model``, as ``LLM`` builds it (``settings`` are
    ``LLM``'s: ``bugs``, ``parts``, ``dtype``, ...), its weights left readable. Inside ranks the rank comes
    from the process group; in one process, ``tp_rank`` builds any rank's shard (to look at its weights:
    its collectives need the real ranks).

    ``model`` may also be an ``EngineConfig`` made in the parent process (then the other settings come
    from it): a rank then need not read config.json again, nor import transformers to do it."""
    if isinstance(model, EngineConfig):
        cfg, tensor_parallel_size = model, model.tensor_parallel_size
    else:
        cfg = engine_config(model, tensor_parallel_size=tensor_parallel_size, device=str(device), **settings)
    tp_size = tensor_parallel_size if tp_rank is not None else None
    return build_model(cfg, device, tp_rank, tp_size, pack=False)[0]     # weights stay readable


class SequenceCache:
    """The KV cache of one sequence of at most ``max_len`` tokens (one block), and how full it is."""

    def __init__(self, model, max_len: int):
        config, device = model.config, next(model.parameters()).device
        heads, kv_heads = local_head_counts(config, model.tp_size)
        attention = type(model.model.layers[0].self_attn.attn)           # the layout its attention part uses
        shape = cache_shape_of(attention, 1, max_len, heads, kv_heads, head_dim_of(config))
        dtype = next(model.parameters()).dtype
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in model.model.layers]
        self.max_len, self.num_tokens, self.device = max_len, 0, device


@dataclass
class Probe:
    logits: torch.Tensor                # (T, V) full logits of every token fed, on every rank
    outputs: dict[str, torch.Tensor]    # module name -> its output, (T, last dim), float, on the CPU
    inputs: dict[str, tuple]            # module name -> the positional arguments it was called with
    cache: SequenceCache                # pass it back to ``probe`` to continue the same sequence


@contextlib.contextmanager
def capture(model: torch.nn.Module, outputs_of=(), inputs_of=()):
    """Forward hooks on the named modules of ``model`` (tplab's or HF's: both use HF's names) for the
    duration of the ``with``; yields ``(outputs, inputs)``, the dicts they fill."""
    outputs, inputs, hooks, modules = {}, {}, [], dict(model.named_modules())
    missing = [n for n in (*outputs_of, *inputs_of) if n not in modules]
    if missing:
        raise KeyError(f"no module named {missing[0]!r} in the model (names are HF's, e.g. 'model.layers.0.mlp')")

    def keep_output(_, __, out, name):
        out = out[0] if isinstance(out, tuple) else out
        outputs[name] = out.detach().float().reshape(-1, out.shape[-1]).cpu()

    for name in outputs_of:
        hooks.append(modules[name].register_forward_hook(lambda m, a, o, name=name: keep_output(m, a, o, name)))
    for name in inputs_of:
        hooks.append(modules[name].register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a)))
    try:
        yield outputs, inputs
    finally:
        for h in hooks:
            h.remove()


def probe(model, token_ids, *, outputs_of=(), inputs_of=(), positions=None, cache: SequenceCache | None = None,
          max_len: int | None = None) -> Probe:
    """Feed ``token_ids`` (the next tokens of one sequence) through one rank's ``model``, with hooks on
    ``outputs_of`` / ``inputs_of``. Their K/V go into ``cache`` (a new one of ``max_len`` tokens, by
    default as many as ``token_ids``), after the tokens already there.

    ``positions`` overrides the positions RoPE sees (by default each token's place in the sequence);
    the K/V still go to the next slots. Only for showing what a wrong position does."""
    token_ids = [int(t) for t in token_ids]
    cache = cache or SequenceCache(model, max_len or len(token_ids))
    start, end = cache.num_tokens, cache.num_tokens + len(token_ids)
    if end > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} tokens; {start} are in it and {len(token_ids)} more "
                         "do not fit: pass a larger max_len to the first probe")
    meta = build_metadata([end - start], [end], [[0]], cache.max_len, cache.device)
    if positions is not None:
        meta = dataclasses.replace(meta, positions=torch.as_tensor(positions, device=cache.device))
    with torch.inference_mode(), capture(model, outputs_of, inputs_of) as (outputs, inputs):
        hidden = model(torch.tensor(token_ids, device=cache.device), cache.kv_caches, meta)   # (T, E)
        logits = model.compute_logits(hidden)                                               # (T, V)
    cache.num_tokens = end
    return Probe(logits, outputs, inputs, cache)
