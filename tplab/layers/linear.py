"""Tensor-parallel linear layers, Megatron/vLLM style.

``nn.Linear.weight`` is ``(out_features, in_features)``. Column parallel splits
dim 0 (each rank computes a slice of the outputs, no communication); row parallel
splits dim 1 (each rank holds a slice of the inputs and produces a partial sum that
an all-reduce completes). Every layer has the same three parts: ``__init__`` works
out this rank's shard sizes, ``weight_loader`` narrows a checkpoint tensor to that
shard, ``forward`` runs the shard.
"""
import os

import torch
import torch.nn.functional as F
from torch import nn

from tplab.layers.weights import copy_into, expect_shape
from tplab.distributed.parallel_state import all_reduce, divide, tp_rank_and_size


def _onednn_works() -> bool:
    if os.environ.get("TPLAB_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_works()


# The row count oneDNN is told to pack a weight for. It picks the layout from it: here 4 and 16 give
# the same blocked layout (AB16b64a), 1 gives the plain one (no faster at 16 rows).
PACK_FOR_ROWS = 4


def _packing_works() -> bool:
    if not _ONEDNN or os.environ.get("TPLAB_PACK_WEIGHTS", "1") == "0":
        return False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.ones(2, 32, dtype=dtype), torch.ones(8, 32, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w)):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False


_PACK = _packing_works()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. On CPU through oneDNN's inner product: torch's default CPU path
    (MKL) streams fp32 weights at about half the memory bandwidth for the few rows of a decode
    step, and decode is nothing but streaming weights (bench/ measures it; ``TPLAB_ONEDNN=0``
    switches back to ``F.linear``). Same maths; the summation order differs at the 1e-7 level.
    ``weight`` may be a plain tensor or one packed by ``pack_linear_weights``."""
    if _ONEDNN and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``packed(weight)`` packs: packing on and available, a CPU weight in fp32 or bf16."""
    return _PACK and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered once into oneDNN's blocked layout for ``linear`` (None where it cannot be)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS) if can_pack(weight) else None


def pack_linear_weights(model: nn.Module) -> int:
    """After loading, on CPU: reorder the weight of every tplab linear layer once into oneDNN's
    blocked layout, and drop the plain copy (vLLM's CPU backend does the same after loading);
    returns how many layers were packed. (The LM head is packed by ``pack_lm_head``.)

    Why: a matmul over the 16 rows of a batch of decodes runs about 1.5x faster on a packed fp32
    weight, a prefill's about 10% faster, and a bf16 weight streams half the bytes of fp32 only when
    packed (on a plain one oneDNN reorders it on every call). The price: a single sequence's fp32
    decode (one row) runs about 10% slower than on the plain layout (bench/, README). The layer's ``weight`` stays a
    parameter of the same shape and dtype on the ``meta`` device (its bytes still count in
    ``param_bytes``; reading its values is an error), and ``packed_weight`` holds the numbers.
    Only layers whose ``forward`` is tplab's own are packed: a replacement part that reads
    ``self.weight`` keeps it. ``TPLAB_PACK_WEIGHTS=0`` (or ``TPLAB_ONEDNN=0``) turns it off."""
    count = 0
    for module in model.modules():
        if not (isinstance(module, LinearBase) and type(module).forward in _OWN_FORWARDS):
            continue
        weight = module.weight
        module.packed_weight = packed(weight)
        if module.packed_weight is None:
            continue
        module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                     requires_grad=False)
        count += 1
    return count


class LinearBase(nn.Module):
    """A ``(out_local, in_local)`` weight (and optional ``out_local`` bias) with a ``weight_loader``."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight = None        # set by pack_linear_weights once the weights are loaded

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight if self.packed_weight is None else self.packed_weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y_local = x @ W[rows of this rank].T``: shard dim 0 (out_features); output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank=None, tp_size=None):
        _, size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        super().__init__(input_size, divide(output_size, size, "output_size"), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        expect_shape(loaded, (self.output_size, *param.shape[1:]))
        rows = param.shape[0]
        copy_into(param.data, loaded.narrow(0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (Qwen2's gate_proj | up_proj).

    Contract of ``Parts.gate_up_linear`` (what a replacement keeps):
    - ``__init__(input_size, output_sizes, bias=False, tp_rank=None, tp_size=None)``: ``output_sizes``
      is ``[intermediate_size, intermediate_size]``, the *full* sizes of gate_proj and up_proj.
    - ``weight``: this rank's ``(sum(output_sizes) / tp_size, input_size)`` rows, laid out as
      ``[gate rows of this rank | up rows of this rank]``, with ``weight.weight_loader``.
    - ``weight_loader(param, loaded, shard_id)``: ``shard_id`` 0 is gate_proj, 1 is up_proj; ``loaded``
      is the full ``(intermediate_size, input_size)`` checkpoint tensor (or a lazy slice of it).
    - ``forward(x)``: ``(T, input_size) -> (T, sum(output_sizes) / tp_size)``, no communication.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank=None, tp_size=None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id: int):
        expect_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        rows = divide(self.output_sizes[shard_id], self.tp_size, "output_size")
        offset = sum(divide(s, self.tp_size) for s in self.output_sizes[:shard_id])
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, self.tp_rank * rows, rows))


class QKVParallelLinear(LinearBase):
    """q_proj | k_proj | v_proj fused, sharded by attention head.

    Takes the *global* head counts and derives this rank's sizes itself:
    ``num_heads = total_num_heads / tp_size`` query heads and
    ``num_kv_heads = total_num_kv_heads / tp_size`` KV heads. When tp_size exceeds
    the KV heads (e.g. 2 KV heads at TP 4), each KV head is replicated on
    ``tp_size / total_num_kv_heads`` ranks, as vLLM does: a rank keeps the one KV
    head its query heads attend with.

    Contract of ``Parts.qkv_linear`` (what a replacement keeps):
    - ``__init__(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=True, tp_rank=None,
      tp_size=None)``.
    - ``weight``: ``((H + 2 H_kv) * head_size, hidden_size)`` with this rank's H query and H_kv KV heads,
      rows laid out ``[q | k | v]``; ``bias`` likewise; both carry ``weight_loader``.
    - ``weight_loader(param, loaded, shard_id)``: ``shard_id`` is ``"q"``, ``"k"`` or ``"v"``; ``loaded``
      is the full checkpoint tensor of q_proj (or k_proj, v_proj), weight or bias.
    - ``forward(x)``: ``(T, hidden_size) -> (T, (H + 2 H_kv) * head_size)``, no communication.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True, tp_rank=None, tp_size=None):
        rank, size = tp_rank_and_size(tp_rank, tp_size)
        check_heads_divisible(total_num_heads, total_num_kv_heads, size)
        self.hidden_size, self.head_size = hidden_size, head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // size
        self.num_kv_heads = max(1, total_num_kv_heads // size)
        self.num_kv_head_replicas = max(1, size // total_num_kv_heads)
        self.q_size = self.num_heads * head_size        # this rank's query width
        self.kv_size = self.num_kv_heads * head_size    # this rank's key (and value) width
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, rank, size)
        assert self.weight.shape == (self.q_size + 2 * self.kv_size, hidden_size)

    def weight_loader(self, param, loaded, shard_id: str):
        if shard_id == "q":
            full, rows, offset = self.total_num_heads * self.head_size, self.q_size, 0
            start = self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            full, rows = self.total_num_kv_heads * self.head_size, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            # Ranks r*replicas ... (r+1)*replicas-1 share KV head group r.
            start = (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        expect_shape(loaded, (full, *param.shape[1:]))
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T, q_size + 2 kv_size)`` -> q ``(T, q_size)``, k and v ``(T, kv_size)``."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """``y = sum_r x[:, cols of r] @ W[:, cols of r].T``: shard dim 1 (in_features), then all-reduce.

    The bias is added on rank 0 only, before the all-reduce, so it is counted once.
    With ``reduce_results=False`` the layer returns this rank's partial sum.

    Contract of ``Parts.row_linear`` (o_proj and down_proj; what a replacement keeps):
    - ``__init__(input_size, output_size, bias=False, tp_rank=None, tp_size=None)``: full sizes;
      ``tp_rank``/``tp_size`` default to the process group's (``parallel_state.tp_rank_and_size``).
    - ``weight``: this rank's ``(output_size, input_size / tp_size)`` columns; ``bias`` (if any) the
      full ``(output_size,)``; both carry ``weight_loader``.
    - ``weight_loader(param, loaded, shard_id=None)``: ``loaded`` is the full checkpoint tensor,
      ``(output_size, input_size)`` (or ``(output_size,)`` for the bias), or a lazy slice of it.
    - ``forward(x)``: ``(T, input_size / tp_size)``, this rank's slice of the features, ->
      ``(T, output_size)``, the full sum, the same on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 tp_rank=None, tp_size=None):
        _, size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.reduce_results = reduce_results
        super().__init__(divide(input_size, size, "input_size"), output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is not sharded
            expect_shape(loaded, param.shape)
            copy_into(param.data, loaded)
            return
        expect_shape(loaded, (self.output_size, self.input_size))
        cols = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.packed_weight is None else self.packed_weight
        y = linear(x, weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y, self.tp_size) if self.reduce_results else y


_OWN_FORWARDS = (LinearBase.forward, RowParallelLinear.forward)   # the forwards that read packed_weight


def valid_tp_sizes(total_num_heads: int, total_num_kv_heads: int, *other_sizes: int) -> list[int]:
    """Every TP size that splits the query heads, the KV heads (or replicates them) and ``other_sizes``."""
    def ok(tp):
        kv_ok = total_num_kv_heads % tp == 0 if tp <= total_num_kv_heads else tp % total_num_kv_heads == 0
        return total_num_heads % tp == 0 and kv_ok and all(s % tp == 0 for s in other_sizes)
    return [tp for tp in range(1, total_num_heads + 1) if ok(tp)]


def check_heads_divisible(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> None:
    """Raise a ValueError that lists the TP sizes that work when ``tp_size`` does not split the heads."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size in valid_tp_sizes(total_num_heads, total_num_kv_heads):
        return
    if total_num_heads % tp_size:
        why = f"{total_num_heads} query heads are not divisible by {tp_size}"
    elif tp_size <= total_num_kv_heads:
        why = f"{total_num_kv_heads} KV heads are not divisible by {tp_size}"
    else:
        why = f"{tp_size} is not a multiple of the {total_num_kv_heads} KV heads, so they cannot be replicated evenly"
    raise ValueError(f"tensor_parallel_size={tp_size} does not work: {why}. "
                     f"TP sizes that work: {valid_tp_sizes(total_num_heads, total_num_kv_heads)}")
