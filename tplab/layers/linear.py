"""Tensor-parallel linear layers, Megatron/vLLM style.

``nn.Linear.weight`` is ``(out_features, in_features)``. Column parallel splits
dim 0 (each rank computes a slice of the outputs, no communication); row parallel
splits dim 1 (each rank holds a slice of the inputs and produces a partial sum that
an all-reduce completes). Every layer has the same three parts: ``__init__`` works
out this rank's shard sizes, ``weight_loader`` narrows a checkpoint tensor to that
shard, ``forward`` runs the shard.
"""
import torch
from torch import nn

from tplab.distributed.parallel_state import all_reduce, divide, tp_rank_and_size
from tplab.layers.linear_method import UsesLinearMethod
from tplab.layers.weights import copy_into, expect_shape


class LinearBase(nn.Module, UsesLinearMethod):
    """A ``(out_local, in_local)`` weight (and optional ``out_local`` bias) with a ``weight_loader``.

    ``forward`` multiplies through ``self.linear_method`` (``tplab.layers.linear_method``): plain ``F.linear``
    unless the engine hands the layer a faster one (``Parts.gemm``; what that does to the weight:
    ``tplab.kernels.gemm``)."""

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

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)                # (T, out_local)


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
        self.num_heads, self.num_kv_heads = heads_per_rank(total_num_heads, total_num_kv_heads, size)
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
            # Ranks g*replicas ... (g+1)*replicas-1 share KV head group g.
            start = (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        expect_shape(loaded, (full, *param.shape[1:]))
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T, q_size + 2 kv_size)`` -> q ``(T, q_size)``, k and v ``(T, kv_size)``."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class ReturnsPartialSums:
    """A ``Parts.row_linear`` or ``Parts.embedding`` that can also be built with ``reduce_results=False`` (a
    keyword of its ``__init__``): its ``forward`` then returns this rank's partial sum, ``(T, hidden)``, and
    the caller reduces it; sequence parallelism reduce-scatters it over tokens
    (``tplab.models.sequence_parallel``). ``LLM(sequence_parallel=True)`` refuses a row_linear that does not
    declare it; an embedding that does not is all-reduced, and each rank then keeps its own tokens."""


class RowParallelLinear(LinearBase, ReturnsPartialSums):
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

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank=None, tp_size=None,
                 reduce_results: bool = True):
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
        y = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)   # (T, output_size) partial
        return all_reduce(y, self.tp_size) if self.reduce_results else y


def valid_tp_sizes(total_num_heads: int, total_num_kv_heads: int, *other_sizes: int) -> list[int]:
    """Every TP size that splits the query heads, the KV heads (or replicates them) and ``other_sizes``."""
    def ok(tp):
        kv_ok = total_num_kv_heads % tp == 0 if tp <= total_num_kv_heads else tp % total_num_kv_heads == 0
        return total_num_heads % tp == 0 and kv_ok and all(s % tp == 0 for s in other_sizes)
    return [tp for tp in range(1, total_num_heads + 1) if ok(tp)]


def heads_per_rank(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(H, H_kv)`` on one rank: its share of the query heads, and of the KV heads, or the one KV head it
    keeps a replica of when ``tp_size`` exceeds them (as vLLM does)."""
    return total_num_heads // tp_size, max(1, total_num_kv_heads // tp_size)


def returns_partial_sums(part) -> bool:
    """Whether ``part`` (a ``Parts.row_linear`` or ``Parts.embedding``) declares ``ReturnsPartialSums``."""
    return isinstance(part, type) and issubclass(part, ReturnsPartialSums)


def check_heads_divisible(total_num_heads: int, total_num_kv_heads: int, tp_size: int, *other_sizes: int) -> None:
    """Raise a ValueError that lists the TP sizes that work when ``tp_size`` does not split the heads (sizes that
    split ``other_sizes`` too: the model's other sizes TP splits, where the caller knows them)."""
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
                     f"TP sizes that work: {valid_tp_sizes(total_num_heads, total_num_kv_heads, *other_sizes)}")
