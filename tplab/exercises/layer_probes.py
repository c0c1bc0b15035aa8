"""A learner's parallel layer alone: built on every rank, loaded with small known weights, run on
known inputs, and its weights and outputs compared with the right answer and with each usual
mistake (no all-reduce, reduced twice, averaged, bias on every rank, the wrong dimension, ids left
unmasked, a KV head not replicated, no all-gather), so the checker can name the mistake.

``spec_of(name)`` describes the probe of part ``name``; ``run_probe`` runs in each rank (or in this
process at TP 1); ``DIAGNOSE[name]`` reads every rank's result.
"""
import contextlib
from dataclasses import dataclass, replace

import torch
from torch.utils import deterministic

from tplab.exercises import FORGOT_RETURN
from tplab.models.loader import LazySlice

E, I, H, H_KV, D, V = 8, 12, 4, 2, 4, 11      # small, unequal sizes: a swapped dimension shows in a shape


class NamedMistake(RuntimeError):
    """A learner's mistake that a probe found and named in its message: ``check_part`` shows the message as it is."""


class ForgotReturn(NamedMistake):
    """A part's forward returned None, or something other than the tensor the engine takes (a tuple...)."""


def returned(out, what: str):
    """``out``, a part's return, when it is a tensor; else ForgotReturn saying what to return instead (``what``)."""
    if out is None:
        raise ForgotReturn(f"forward {FORGOT_RETURN}")
    if not isinstance(out, torch.Tensor):
        raise ForgotReturn(f"forward returned a {type(out).__name__}, not a tensor: return only {what}")
    return out


class TensorSlice:
    """A checkpoint tensor as the engine's loader hands it over: ``.shape``, ``.narrow``, ``materialize()``."""

    def __init__(self, tensor: torch.Tensor):
        self._t, self.shape = tensor, tuple(tensor.shape)

    __getitem__ = LazySlice.__getitem__                # says how to take rows instead

    def narrow(self, dim: int, start: int, length: int) -> "TensorSlice":
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"cannot take [{start}:{start + length}] of dim {dim} from shape {self.shape}")
        return TensorSlice(self._t.narrow(dim, start, length))

    def materialize(self) -> torch.Tensor:
        return self._t.clone()


@dataclass
class Spec:
    """How to build, load and run one part in the probe."""
    args: tuple                                   # constructor arguments before tp_rank / tp_size
    kwargs: dict
    weights: list                                 # (parameter name, full checkpoint tensor, shard id)
    x: torch.Tensor                               # the full input
    split_input: bool = False                     # row parallel: rank r gets its slice of x's last dim
    returns: str = "the output tensor"            # what forward returns, for a message when it returns another thing


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def row_spec():
    w, b = _randn(E, I, seed=1), _randn(E, seed=2)
    return Spec((I, E), {"bias": True}, [("weight", w, None), ("bias", b, None)], _randn(3, I, seed=3), True,
                "the (T, output_size) output, the bias already added in it (once)")


def gate_up_spec():
    g, u = _randn(I, E, seed=4), _randn(I, E, seed=5)
    return Spec((E, [I, I]), {"bias": False}, [("weight", g, 0), ("weight", u, 1)], _randn(3, E, seed=6),
                returns="the (T, sum(output_sizes) / tp) output: this rank's gate columns, then its up columns")


def qkv_spec():
    q, k, v = _randn(H * D, E, seed=7), _randn(H_KV * D, E, seed=8), _randn(H_KV * D, E, seed=9)
    bq, bk, bv = _randn(H * D, seed=10), _randn(H_KV * D, seed=11), _randn(H_KV * D, seed=12)
    weights = [("weight", q, "q"), ("weight", k, "k"), ("weight", v, "v"), ("bias", bq, "q"), ("bias", bk, "k"),
               ("bias", bv, "v")]
    return Spec((E, D, H, H_KV), {"bias": True}, weights, _randn(3, E, seed=13),
                returns="the one (T, q_size + 2 * kv_size) output, [q | k | v]: the engine splits it")


def embedding_spec():
    ids = torch.cat([torch.arange(V), torch.tensor([V - 1, 0, 5])])          # every id, a few repeated
    return Spec((V, E), {}, [("weight", _randn(V, E, seed=14), None)], ids, returns="the (T, E) embeddings")


def lm_head_spec():
    return Spec((V, E), {}, [("weight", _randn(V, E, seed=15), None)], _randn(3, E, seed=16),
                returns="the (T, vocab_size) logits, every rank's columns gathered")


def device_or_dtype_mistake(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """A sentence when ``got`` (a part's parameter or output) is not on the device, or in the dtype, the engine
    runs in."""
    if isinstance(got, torch.Tensor) and got.device != want.device:
        return (f"{what} is on device {got.device}, but the engine runs this layer on {want.device} (its input's): "
                "make new tensors with device=x.device, and keep results where they were computed")
    if not isinstance(got, torch.Tensor) or got.dtype == want.dtype:
        return None
    return (f"{what} is {got.dtype}, but the engine runs this layer in {want.dtype} (the model's dtype: its "
            f"input's and its weights'): make new tensors with dtype=x.dtype (or the default dtype, which the "
            f"engine sets to the model's), or cast with .to(x.dtype)")


def vocab_shards(w: torch.Tensor, tp: int) -> tuple[int, list[torch.Tensor]]:
    """``w`` (V, E) padded with zero rows to a multiple of ``tp``: rows per rank, and each rank's (per_rank, E)."""
    per_rank = -(-V // tp)
    padded = torch.cat([w, w.new_zeros(per_rank * tp - V, E)])
    return per_rank, list(padded.split(per_rank))


# check_part's hints for errors raised in these parts: (part or None, words in the error, a tuple: all; the hint).
# A part's own hint replaces the general one (None) with the same words.
LAYER_HINTS = [
    (None, "cannot take [", "a narrow past the end of the checkpoint tensor: this rank's rows (or columns) start at "
           "tp_rank * its share (the full size // tp_size), ranks counting from 0"),
    ("qkv_linear", "cannot take [", "a narrow past the end of the checkpoint tensor: q's rows start at tp_rank * "
                   "q_size, but with more ranks than KV heads (tp_size > total_num_kv_heads) neighbouring ranks share "
                   "a KV head, replicas = tp_size // total_num_kv_heads of them: k's and v's rows start at "
                   "(tp_rank // replicas) * kv_size"),
    (None, "exceeds dimension size", "a narrow past the end of this rank's parameter: offsets and sizes inside it are "
           "this rank's (the full size // tp_size), not the checkpoint's"),
    (None, "shard: expected shape", "what you copy must have the shape of where it goes: this rank's share, "
           "loaded.narrow(dim, tp_rank * share, share) with share = the full size // tp_size, into a param laid out "
           "as the checkpoint, (out, in), not transposed"),
    (None, "for +: 'Tensor' and 'NoneType'", "self.bias is None when the layer is built with bias=False (o_proj, "
           "down_proj and gate_up_proj in Qwen2): add it only `if self.bias is not None`"),
    (None, ("tuple index out of range", "weight_loader"), "the weight_loader loads the bias too, a 1-D tensor "
           "(param.dim() == 1, no dim 1): handle it on its own"),
    ("row_linear", "shapes cannot be multiplied", "x is already this rank's features, (T, input_size / tp_size), and "
                   "self.weight (output_size, input_size / tp_size): y = x @ self.weight.T, x not sliced again"),
    *((part, "shapes cannot be multiplied", "x is the full (T, input_size) on every rank, and self.weight (this "
             "rank's rows, input_size): y = x @ self.weight.T") for part in ("gate_up_linear", "qkv_linear")),
]

SPECS = {"row_linear": row_spec, "gate_up_linear": gate_up_spec, "qkv_linear": qkv_spec,
         "embedding": embedding_spec, "lm_head": lm_head_spec}


def spec_of(name: str, one_row: bool = False) -> Spec:
    """The probe of part ``name``; with ``one_row``, its input's first row alone: a decode step of one
    sequence, the ``T == 1`` a learner's shape handling can get wrong while every longer input passes."""
    spec = SPECS[name]()
    return replace(spec, x=spec.x[:1]) if one_row else spec


@contextlib.contextmanager
def empty_is_nan():
    """``torch.empty`` fills with NaN inside (PyTorch's ``fill_uninitialized_memory``, on while deterministic
    algorithms are): what a part's loader never wrote reads NaN, not whatever the allocator left there, which
    can be a checkpoint's numbers freed a moment before. ``torch.zeros`` and the like are unchanged."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def run_probe(impl, spec: Spec, tp_rank: int, tp_size: int, forward: bool = True) -> dict:
    """Build ``impl`` for this rank, load the spec's weights through its ``weight_loader``s, and run
    forward (unless ``forward`` is False: the loaded weights can be judged even if forward fails)."""
    with empty_is_nan():
        layer = impl(*spec.args, **spec.kwargs, tp_rank=tp_rank, tp_size=tp_size)
    for name, full, shard_id in spec.weights:
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            raise AttributeError(f"the layer has no tensor `{name}`: the engine loads the checkpoint into "
                                 f"`self.{name}` (an nn.Parameter)")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise AttributeError(f"`self.{name}` has no weight_loader: set `self.{name}.weight_loader = "
                                 "self.weight_loader` in __init__, the engine's loader calls it")
        loader(param, TensorSlice(full), shard_id)
    params = {n: p.detach().clone() for n, p in layer.named_parameters()}
    if not forward:
        return {"params": params}
    x = spec.x
    if spec.split_input:
        cols = x.shape[-1] // tp_size
        x = x[:, tp_rank * cols:(tp_rank + 1) * cols]
    with torch.no_grad():
        out = returned(layer(x.clone()), spec.returns)
    return {"params": params, "out": out.detach().clone()}


def probe_in_rank(impl, name: str, tp_size: int, forward: bool = True, one_row: bool = False) -> dict:
    """Inside a rank of a process group: the probe of part ``name`` (``spec_of``) for this rank."""
    import torch.distributed as dist
    return run_probe(impl, spec_of(name, one_row), dist.get_rank(), tp_size, forward)

