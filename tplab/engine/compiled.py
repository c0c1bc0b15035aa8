"""The compiled path (``EngineConfig.compile``, ``TPLAB_COMPILE=1``): a rank's model forward through
``torch.compile`` with inductor, which on CPU writes C++ for the ops between the matmuls and builds it
with the machine's C++ compiler. Opt-in: the eager path is the default and the reference.

What is compiled: the whole forward of the model, embedding to final norm, as one graph, except
attention. Attention reads the step's metadata (Python lists of sequence lengths that change every
step) and runs a Python loop over sequences, so tracing it would recompile every step; here it is one
opaque op per layer (``tplab::attention``, as vLLM's ``unified_attention``), which runs the layer's own
attention part eagerly. Its inputs are q, k, v and the layer's index; the KV cache and the metadata of
the step come from ``_step``, set around each forward (the op writes the cache in place, which a
functional graph must not see, or it would copy the cache). What inductor gains between two
attentions: the residual add, RMSNorm, RoPE and SiLU-and-mul each become one loop in C++ instead of a
handful of dispatched ops; the matmuls stay the same library calls (oneDNN on packed weights, or
``F.linear``), and the collectives of TP > 1 break the graph where they run.

Shapes: a step feeds T tokens, any number. ``dynamic=True`` compiles T as a symbol, so prefill chunks
and decode steps of 2..512 tokens share one graph; T = 1 (a lone sequence's decode, the step that
runs most) gets a graph of its own, specialised, as dynamo does for size 1. Two compiles per shape of
model, no padding to buckets (attention would have to ignore padded tokens).

Cost: the first start compiles (tens of seconds on 2 cores); inductor's FX graph cache on disk
(``TORCHINDUCTOR_CACHE_DIR``, default under /tmp) makes later starts on the machine cheap. Where no
C++ compiler is present, or compiling fails, the model runs eagerly and one line says so, once per
process.
"""
import functools
import sys

import torch
from torch import nn

from tplab.distributed import parallel_state

_step: dict = {"kv_caches": None, "meta": None, "attentions": None}   # the step being run
_said: set[str] = set()                                               # fallback lines printed


@torch.library.custom_op("tplab::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention part on this step: q ``(T, H, D)``, k and v ``(T, H_kv, D)`` -> ``(T, H * D)``.
    Writes k and v into the layer's KV cache (``_step``), which the graph never holds."""
    out = _step["attentions"][layer](q, k, v, _step["kv_caches"][layer], _step["meta"])
    return out.clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out


@_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# The collectives, as ops the graph holds (dynamo cannot trace shared memory or a process group): each runs
# tplab's own collective on a copy (an op may not return its input), so the path and the bits are the same.
@torch.library.custom_op("tplab::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    return parallel_state.all_reduce(x.clone(), tp_size)


@torch.library.custom_op("tplab::all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, tp_size: int, dim: int) -> torch.Tensor:
    return parallel_state.all_gather(x, tp_size, dim)


@torch.library.custom_op("tplab::reduce_scatter", mutates_args=())
def _reduce_scatter(x: torch.Tensor, tp_size: int, dim: int) -> torch.Tensor:
    return parallel_state.reduce_scatter(x, tp_size, dim)


@_all_reduce.register_fake
def _(x, tp_size):
    return torch.empty_like(x)


@_all_gather.register_fake
def _(x, tp_size, dim):
    shape = list(x.shape)
    shape[dim] *= tp_size
    return x.new_empty(shape)


@_reduce_scatter.register_fake
def _(x, tp_size, dim):
    shape = list(x.shape)
    shape[dim] //= tp_size
    return x.new_empty(shape)


@functools.cache
def _collectives_as_ops() -> None:
    """Where dynamo meets ``parallel_state``'s collectives it traces these instead (once per process)."""
    from torch._dynamo import substitute_in_graph

    @substitute_in_graph(parallel_state.all_reduce)
    def all_reduce(x, tp_size):
        return x if tp_size == 1 else torch.ops.tplab.all_reduce(x, tp_size)

    @substitute_in_graph(parallel_state.all_gather)
    def all_gather(x, tp_size, dim=-1):
        return x if tp_size == 1 else torch.ops.tplab.all_gather(x, tp_size, dim)

    @substitute_in_graph(parallel_state.reduce_scatter)
    def reduce_scatter(x, tp_size, dim=0):
        return x if tp_size == 1 else torch.ops.tplab.reduce_scatter(x, tp_size, dim)


class OpaqueAttention(nn.Module):
    """Stands where a layer's attention part was while the model is compiled: calls ``tplab::attention``."""

    def __init__(self, inner: nn.Module, index: int):
        super().__init__()
        self.inner, self.index = inner, index

    def forward(self, q, k, v, kv_cache, meta):
        return torch.ops.tplab.attention(q, k, v, self.index)    # (T, H * D)


def compiler_problem() -> str | None:
    """Why inductor cannot build C++ here (no working C++ compiler), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:   # InvalidCxxCompiler, or an inductor that cannot be imported
        return f"{type(e).__name__}: {e}".rstrip(": ") or type(e).__name__
    return None


def say_once(what: str) -> None:
    """One line on stderr, once per process: the compiled path was asked for and eager runs instead."""
    if what in _said:
        return
    _said.add(what)
    print(f"tplab: compile=True but {what}; running the eager model (same results, slower)", file=sys.stderr)


class CompiledForward:
    """``model.forward`` while the model is compiled: sets ``_step`` around the compiled forward, and on a
    compile failure puts the eager model back for good and runs the step eagerly."""

    def __init__(self, model: nn.Module, options: dict | None = None):
        self.model, self.eager = model, model.forward
        self.slots = [(m, m.attn) for m in model.modules() if isinstance(getattr(m, "attn", None), nn.Module)]
        for i, (parent, attn) in enumerate(self.slots):
            parent.attn = OpaqueAttention(attn, i)
        self.attentions = [attn for _, attn in self.slots]
        self.options = {"freezing": True, **(options or {})}
        self.compiled = torch.compile(self.eager, dynamic=True)
        self.failed = False

    def __call__(self, input_ids, kv_caches, meta):
        if self.failed:
            return self.eager(input_ids, kv_caches, meta)
        if len(kv_caches) != len(self.attentions):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.attentions)} attention layers")
        _step.update(kv_caches=kv_caches, meta=meta, attentions=self.attentions)
        try:
            import torch._inductor.config
            with torch._inductor.config.patch(self.options):   # dynamo reads freezing too, as it traces
                return self.compiled(input_ids, kv_caches, meta)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if self.fall_back is None: raise
            self.fall_back(f"compiling failed ({type(getattr(e, 'inner_exception', e)).__name__})")
            return self.eager(input_ids, kv_caches, meta)
        finally:
            _step.update(kv_caches=None, meta=None)

    def fall_back(self, why: str) -> None:
        """Put every attention part back and run eagerly from now on."""
        for parent, attn in self.slots:
            parent.attn = attn
        del self.model.forward
        self.failed = True
        say_once(why)


def _weights_as_buffers(model: nn.Module) -> None:
    """Each linear layer's packed weight (``cpu_gemm``) becomes a buffer of its layer, which ``freezing`` folds
    into the graph as a constant, as it does the parameters (inductor's oneDNN linear takes constants only)."""
    for m in model.modules():
        packed = vars(m).get("packed_weight")
        if isinstance(packed, torch.Tensor):
            del m.packed_weight
            m.register_buffer("packed_weight", packed, persistent=False)


def compile_model(model: nn.Module, options: dict | None = None) -> bool:
    """Run ``model``'s forward through ``torch.compile`` from its next call; whether it will (False, with
    one line on stderr, where this machine has no C++ compiler)."""
    problem = compiler_problem()
    if problem is not None:
        say_once(f"no C++ compiler for inductor ({problem})")
        return False
    _collectives_as_ops()
    _weights_as_buffers(model)
    model.forward = CompiledForward(model, options)
    return True
