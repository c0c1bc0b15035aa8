"""The compiled path (``EngineConfig.compile``, ``TPLAB_COMPILE=1``): a rank's model forward through
``torch.compile`` with inductor (C++ on CPU, Triton on a GPU). Opt-in: the eager path is the default and the
reference. The whole forward is one graph, in which each linear layer and each attention is one opaque op
(``tplab::linear``, ``tplab::attention``) running the part's own eager ``forward``, as vLLM's graphs hold
``unified_attention``: attention reads per-step Python metadata and loops over sequences (traced, it would
recompile every step) and writes the KV cache in place; a linear layer's method may multiply by a packed
weight that only a frozen graph could hold. What inductor fuses is what lies between: RMSNorm with its
residual add, RoPE, SiLU-and-mul. ``dynamic=True``: one graph for every token count, one more for T = 1.
The first start compiles; inductor's cache on disk makes later starts take seconds. Where no C++ compiler
is present, or compiling fails, the model runs eagerly and one line says so. Measurements: docs/performance.md.
"""
import functools
import os
import sys
import types

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from tplab.distributed import parallel_state
from tplab.layers.linear_method import UsesLinearMethod

_step: dict = {"kv_caches": None, "meta": None, "attentions": None, "linears": None}   # the step being run
_said: set[str] = set()                                                             # fallback lines printed


_LIB = torch.library.Library("tplab", "FRAGMENT")


def _op(fake):
    """Make the function ``tplab::<its name without the underscore>``, an op for every device, with ``fake``
    (its output's shape) for tracing. Defined on the dispatcher directly, as vLLM's
    ``direct_register_custom_op`` does: ``torch.library.custom_op`` wraps every call in a Python layer
    of its own, and a step calls these ops in every layer (what that cost: docs/performance-journal.md)."""
    def define(fn):
        name = fn.__name__.lstrip("_")
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        _LIB._register_fake(name, fake)
        return fn
    return define


def _resized(x, dim, size):
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


@_op(fake=lambda q, k, v, layer: q.new_empty(q.shape[0], q.shape[1] * q.shape[2]))
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention part on this step: q ``(T, H, D)``, k and v ``(T, H_kv, D)`` -> ``(T, H * D)``.
    Writes k and v into the layer's KV cache (``_step``), which the graph never holds."""
    out = _step["attentions"][layer](q, k, v, _step["kv_caches"][layer], _step["meta"])
    return out.clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out


@_op(fake=lambda x, index, out_features: _resized(x, -1, out_features))
def _linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """Linear layer ``index`` of the model, its own ``forward``: ``(T, in) -> (T, out_features)``."""
    out = _step["linears"][index](x)
    return out.clone() if out.data_ptr() == x.data_ptr() else out


# The collectives, as ops the graph holds (dynamo cannot trace shared memory or a process group): each runs
# tplab's own collective on a copy (an op may not return its input), so the path and the bits are the same.
@_op(fake=lambda x, tp_size: torch.empty_like(x))
def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    return parallel_state.all_reduce(x.clone(), tp_size)


@_op(fake=lambda x, tp_size, dim: _resized(x, dim, x.shape[dim] * tp_size))
def _all_gather(x: torch.Tensor, tp_size: int, dim: int) -> torch.Tensor:
    return parallel_state.all_gather(x, tp_size, dim)


@_op(fake=lambda x, tp_size, dim: _resized(x, dim, x.shape[dim] // tp_size))
def _reduce_scatter(x: torch.Tensor, tp_size: int, dim: int) -> torch.Tensor:
    return parallel_state.reduce_scatter(x, tp_size, dim)


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


def _opaque_attention(self, q, k, v, kv_cache, meta):
    """An attention part's ``forward`` while the model is compiled: ``tplab::attention``."""
    return torch.ops.tplab.attention(q, k, v, self.tplab_op_index)                # (T, H * D)


def _opaque_linear(self, x):
    """A linear layer's ``forward`` while the model is compiled: ``tplab::linear``."""
    return torch.ops.tplab.linear(x, self.tplab_op_index, self.tplab_out_features)   # (T, out_features)


def compiler_problem() -> str | None:
    """Why inductor cannot build C++ here (no working C++ compiler), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
    except Exception as e:   # InvalidCxxCompiler, or an inductor that cannot be imported
        return f"{type(e).__name__}: {e}".rstrip(": ") or type(e).__name__
    return None


def say_once(what: str) -> None:
    """One line on stderr, once per process (at TP > 1 from rank 0 only): the compiled path was asked for
    and the eager one runs instead."""
    if what in _said or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _said.add(what)
    print(f"tplab: compile=True but {what}; running the eager model (same results, slower)", file=sys.stderr)


def while_compiling(e: BaseException) -> bool:
    """Whether ``e`` came from dynamo or inductor compiling (tracing, lowering, the C++ build), not from
    running the model: a dynamo error, or raised under ``convert_frame``, where every compile starts."""
    if isinstance(e, torch._dynamo.exc.TorchDynamoException):
        return True
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("_dynamo", "convert_frame.py")):
            return True
        tb = tb.tb_next
    return False


def _opaque(model: nn.Module) -> tuple[list, list]:
    """Give every attention part and every linear layer of ``model``'s forward (each layer that declares it
    multiplies through a linear method; the LM head, used after the forward, keeps its own) an opaque
    ``forward``; their eager forwards, by index, for the ops."""
    attentions = [layer.self_attn.attn for layer in model.model.layers]     # the Parts.attention of each layer
    linears = [m for name, m in model.named_modules() if isinstance(m, UsesLinearMethod) and name != "lm_head"]
    for i, m in enumerate(attentions):
        _make_opaque(m, _opaque_attention, i)
    for i, m in enumerate(linears):
        _make_opaque(m, _opaque_linear, i, out_features=m.weight.shape[0])
    return [type(m).forward.__get__(m) for m in attentions], [type(m).forward.__get__(m) for m in linears]


def _make_opaque(module: nn.Module, forward, index: int, out_features: int | None = None) -> None:
    """``module.forward`` becomes ``forward``, which calls the op with ``index``, a constant of the graph (each
    call site of the forward has its own), and ``out_features`` (a linear layer's output width)."""
    module.tplab_op_index, module.tplab_out_features = index, out_features
    module.forward = types.MethodType(forward, module)


class CompiledForward:
    """``model.forward`` while it is compiled: sets ``_step`` around each forward, and where
    compiling fails puts the eager model back for good and runs the step eagerly. A failed compile has run
    nothing of the step (the graph runs only once built); where parts of a model break the graph, an
    earlier piece may have written this step's K/V, which the eager run writes again, the same values."""

    def __init__(self, model: nn.Module):
        self.model, self.eager = model, model.forward
        self.attentions, self.linears = _opaque(model)
        self.compiled = torch.compile(self.eager, dynamic=True)   # built at the first forward
        self.failed = False
        self.num_compiled = 0              # forwards that ran compiled (llm.stats()["compiled_forwards"])

    def __call__(self, input_ids, kv_caches, meta):
        if self.failed:
            return self.eager(input_ids, kv_caches, meta)
        if len(kv_caches) != len(self.attentions):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.attentions)} attention layers")
        _step.update(kv_caches=kv_caches, meta=meta, attentions=self.attentions, linears=self.linears)
        try:
            hidden = self.compiled(input_ids, kv_caches, meta)
            self.num_compiled += 1
            return hidden
        except Exception as e:
            if not while_compiling(e):
                raise
            cause = getattr(e, "inner_exception", None) or e
            first_line = (str(cause).strip().splitlines() or [""])[0][:160]
            self.fall_back(f"compiling failed ({type(cause).__name__}: {first_line})")
            return self.eager(input_ids, kv_caches, meta)
        finally:
            _step.update(kv_caches=None, meta=None, attentions=None, linears=None)

    def fall_back(self, why: str) -> None:
        """Give every part its own forward back and run eagerly from now on."""
        for m in self.attentions + self.linears:
            del m.__self__.forward, m.__self__.tplab_op_index
        del self.model.forward
        self.failed = True
        say_once(why)


def compile_model(model: nn.Module, eager_because: str | None = None) -> bool:
    """Run ``model``'s forward through ``torch.compile`` from its next call; whether it will (False, with one
    line on stderr, where this machine has no C++ compiler, or ``eager_because`` says why not)."""
    if isinstance(vars(model).get("forward"), CompiledForward):
        return True
    problem = eager_because or compiler_problem()
    if problem is not None:
        say_once(eager_because or f"no C++ compiler for inductor ({problem})")
        return False
    _collectives_as_ops()
    model.forward = CompiledForward(model)
    return True
