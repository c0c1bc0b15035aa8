"""Mixture of experts on tensor-parallel ranks: vLLM's ``FusedMoE``, in plain torch.

One MoE layer, on each rank (T tokens, hidden size E, X experts of intermediate size I, top k):
    router_logits (T, X) = x @ gate.T                    # the router is replicated: every rank routes every token
    weights, ids  (T, k) = top-k of softmax(logits)      # in fp32 (renormalised or not), then x's dtype, as HF
    for each expert e this rank holds:                   # dispatch
        rows = the tokens that chose e                   # (n_e,)
        y = down_e(silu(gate_e x[rows]) * up_e x[rows])  # (n_e, E)
        out[rows] += weight of e in each row * y         # combine
    out (T, E): a partial sum, completed by one all-reduce

Two placements, with vLLM's names. By default every rank holds every expert, each split by TP as a dense
MLP is (gate and up column parallel over I, down row parallel), so ``out`` sums this rank's I / t columns
of every expert. With ``enable_expert_parallel`` each rank holds X / t whole experts and runs only the
tokens routed to them; every rank sees every token, so ``out`` sums this rank's experts. Either way one
all-reduce completes it; an MoE block's shared expert joins it as ``Qwen2MoeSparseMoeBlock`` says.

Under data parallelism each DP rank has tokens of its own and the experts are spread over every rank of
every DP rank, so tokens travel to their experts and back (``forward_all_to_all``, through the exchange in
``tplab.layers.moe_exchange``).
"""
import torch
import torch.nn.functional as F
from torch import nn

from tplab.distributed.parallel_state import all_reduce, cdiv, divide, dp_rank_and_size, tp_rank_and_size
from tplab.layers.linear_method import UsesProducts
from tplab.layers.moe_exchange import all_to_all_combine, all_to_all_dispatch
from tplab.layers.weights import copy_into, expect_shape


class ReplicatedLinear(nn.Module):
    """``y = x @ W.T`` with the whole ``(output_size, input_size)`` weight on every rank (vLLM's name): the
    router ``gate`` ``(X, E)`` and Qwen2-MoE's ``shared_expert_gate`` ``(1, E)``. Small, so not split."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)                                   # (T, output_size)


class FusedMoE(nn.Module, UsesProducts):
    """This rank's experts of one MoE layer, their weights stacked: routing, dispatch, expert MLPs, combine.

    Contract of ``Parts.experts`` (what a replacement keeps):
    - ``__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize=False, reduce_results=True,
      tp_rank=None, tp_size=None, enable_expert_parallel=False)``: full sizes; ``renormalize`` is HF's
      ``norm_topk_prob`` (the k weights divided by their sum). Under data parallelism the block also passes
      ``dp_rank`` and ``dp_size`` (None: this process's), and ``enable_expert_parallel`` is True.
    - ``gate_up_proj``: ``(X_local, 2 I_local, E)``, each expert's rows laid out ``[gate | up]``, and
      ``down_proj``: ``(X_local, E, I_local)``; both carry ``weight_loader``. Without expert parallelism
      ``X_local = X`` and ``I_local = I / tp_size``; with it ``X_local = X / ep_size`` over ``ep_size = dp_size x
      tp_size`` ranks (rank ``r = dp_rank x tp_size + tp_rank`` holds experts ``r X_local .. (r + 1) X_local - 1``)
      and ``I_local = I``.
    - ``weight_loader(param, loaded, shard_id, expert_id)``: ``loaded`` is expert ``expert_id``'s full
      checkpoint tensor (or a lazy slice of it): ``gate_proj`` (shard_id 0) or ``up_proj`` (1), ``(I, E)``,
      into ``gate_up_proj``; ``down_proj`` (shard_id None), ``(E, I)``. An expert another rank holds: return
      without reading it.
    - ``forward(x, router_logits)``: ``x`` ``(T, E)``, ``router_logits`` ``(T, X)`` -> ``(T, E)``, the sum over
      each token's top-k experts weighted as HF weights them; all-reduced, or with ``reduce_results=False``
      this rank's partial sum (the caller reduces it over TP). Under data parallelism every rank of every DP
      rank calls it once per MoE layer and step, with zero tokens where it has none (the exchange needs all).
    - ``dispatch``, ``combine`` (None: ``all_to_all_dispatch``, ``all_to_all_combine``): the exchange under data
      parallelism, handed over by ``tplab.engine.parts`` where ``Parts.moe_dispatch`` / ``moe_combine`` are replaced.
    - an expert's products go through ``self.linear_method.product`` (``UsesProducts``: ``F.linear`` until the
      engine hands over ``Parts.gemm``'s method after loading).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = False, reduce_results: bool = True, tp_rank=None, tp_size=None,
                 enable_expert_parallel: bool = False, dp_rank=None, dp_size=None, dispatch=None, combine=None):
        super().__init__()
        # under data parallelism, the exchange (Parts.moe_dispatch, Parts.moe_combine)
        self.exchange_dispatch, self.exchange_combine = dispatch or all_to_all_dispatch, combine or all_to_all_combine
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.dp_rank, self.dp_size = dp_rank_and_size(dp_rank, dp_size)
        if self.dp_size > 1 and not enable_expert_parallel:
            raise ValueError(f"dp_size={self.dp_size}: data-parallel ranks share the experts by expert parallelism "
                             "only; build the layer with enable_expert_parallel=True")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size, self.renormalize, self.reduce_results = intermediate_size, renormalize, reduce_results
        # the ranks the experts are spread over: every rank of every DP rank (only this TP group's without DP)
        self.ep_size = self.dp_size * self.tp_size if enable_expert_parallel else 1
        self.ep_rank = self.dp_rank * self.tp_size + self.tp_rank if enable_expert_parallel else 0
        if enable_expert_parallel:           # X / (d t) whole experts on each rank
            self.num_local_experts = divide(num_experts, self.ep_size, "num_experts",
                                            by="the expert-parallel ranks (dp_size x tp_size)")
            self.intermediate_size_per_partition, self.expert_tp_rank = intermediate_size, 0
        else:                                # every expert, each split over the ranks
            self.num_local_experts = num_experts
            self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size, "intermediate_size")
            self.expert_tp_rank = self.tp_rank
        first = self.ep_rank * self.num_local_experts
        self.local_experts = range(first, first + self.num_local_experts)  # global ids of this rank's experts
        x_local, i_local = self.num_local_experts, self.intermediate_size_per_partition
        self.gate_up_proj = nn.Parameter(torch.empty(x_local, 2 * i_local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(x_local, hidden_size, i_local), requires_grad=False)
        self.gate_up_proj.weight_loader = self.down_proj.weight_loader = self.weight_loader

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this class cannot run an engine's experts on ``device`` in ``dtype``, or None (tplab's: anywhere).
        Where a replacement cannot, the engine uses this class instead and says why (``EngineConfig``)."""
        return None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id, expert_id: int) -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id}: the model has {self.num_experts} experts (num_experts)")
        if expert_id not in self.local_experts:
            return                                                        # another rank's expert: not read
        local, rows = expert_id - self.local_experts.start, self.intermediate_size_per_partition
        start = self.expert_tp_rank * rows                                # this rank's I_local of the expert
        if shard_id is None:                                              # down_proj (E, I): split on dim 1
            expect_shape(loaded, (self.hidden_size, self.intermediate_size))
            copy_into(param.data[local], loaded.narrow(1, start, rows))
        else:                                                             # gate_proj / up_proj (I, E): dim 0
            expect_shape(loaded, (self.intermediate_size, self.hidden_size))
            copy_into(param.data[local].narrow(0, shard_id * rows, rows), loaded.narrow(0, start, rows))

    def select_experts(self, router_logits: torch.Tensor, dtype: torch.dtype):
        """``(T, X)`` -> each token's k experts ``ids`` ``(T, k)`` and their ``weights`` ``(T, k)``: softmax in
        fp32, top-k, renormalised to sum to 1 where ``renormalize``, then cast to ``dtype`` (HF's router)."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)   # (T, X)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                 # (T, k) each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), ids

    def rows_by_expert(self, ids: torch.Tensor):
        """For each expert this rank holds that some token chose: ``(local index, rows, slots)``, the tokens
        that chose it ``(n_e,)`` and where in their top-k it is ``(n_e,)`` (an expert is in a row at most once)."""
        chosen = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()   # pairs per expert
        for local, expert in enumerate(self.local_experts):
            if chosen[expert]:                                            # an expert no token chose is skipped
                rows, slots = (ids == expert).nonzero(as_tuple=True)
                yield local, rows, slots

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``local``'s SiLU-gated MLP on its tokens: ``(n, E) -> (n, E)`` (a partial sum under TP)."""
        product = self.linear_method.product                                # F.linear, or Parts.gemm's kernel
        gate, up = product(x, self.gate_up_proj[local]).chunk(2, dim=-1)    # (n, I_local) each
        return product(F.silu(gate) * up, self.down_proj[local])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(router_logits, x.dtype)          # (T, k) each
        if self.dp_size > 1:                                                # tokens travel to the experts
            out = self.forward_all_to_all(x, weights, ids)
        else:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)   # fp32 (HF sums in x's dtype)
            for local, rows, slots in self.rows_by_expert(ids):
                y = self.expert_mlp(local, x.index_select(0, rows))         # (n_e, E)
                out.index_add_(0, rows, (y * weights[rows, slots].unsqueeze(-1)).float())   # combine
        out = out.to(x.dtype)                                                # (T, E)
        return all_reduce(out, self.tp_size) if self.reduce_results else out

    def token_share(self, num_tokens: int) -> slice:
        """The rows of a step's tokens this TP rank sends to the experts under data parallelism: its ``1 / t``
        (every TP rank of a DP rank holds the same tokens; each sends a share, so none is sent twice)."""
        per_rank = cdiv(num_tokens, self.tp_size)
        start = min(num_tokens, self.tp_rank * per_rank)
        return slice(start, min(num_tokens, start + per_rank))

    def forward_all_to_all(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Under data parallelism: this TP rank's share of the tokens to their experts' ranks and back (fp32 ``(T,
        E)``, zero outside the share). Every rank takes part, with no tokens too, or the others would wait."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)    # (T, E)
        share = self.token_share(x.shape[0])
        received, local, order, traffic = self.exchange_dispatch(x[share], ids[share], self.num_experts,
                                                                 self.ep_rank, self.ep_size)
        y = self.run_received(received, local)                              # (R, E)
        out[share] = self.exchange_combine(y, order, traffic, weights[share])   # (T_r, E), fp32
        return out

    def run_received(self, received: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received ``(R, E)``, row i for its local expert ``local[i]``. Returns
        each row's expert output ``(R, E)``."""
        if local.numel() and not 0 <= int(local.min()) <= int(local.max()) < self.num_local_experts:
            raise ValueError(f"rank {self.ep_rank}: the dispatch gave local expert ids {sorted(set(local.tolist()))}, "
                             f"but this rank holds {self.num_local_experts} experts (local ids 0 .. "
                             f"{self.num_local_experts - 1}; global ids {list(self.local_experts)})")
        y = torch.zeros_like(received)
        for e in range(self.num_local_experts):
            rows = (local == e).nonzero().squeeze(1)
            if rows.numel():
                y[rows] = self.expert_mlp(e, received.index_select(0, rows))
        return y


def make_expert_params_mapping(num_experts: int) -> list[tuple[str, str, int, int | None]]:
    """vLLM's ``(param_name, weight_name, expert_id, shard_id)`` for every expert's checkpoint tensors (the
    Hub's names, one per expert: ``experts.3.gate_proj.weight``) onto the stacked parameters
    (``experts.gate_up_proj``, ``experts.down_proj``: HF's own names for them in memory)."""
    projections = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1), ("down_proj", "down_proj", None))
    return [(f"experts.{param}", f"experts.{e}.{proj}.weight", e, shard)
            for e in range(num_experts) for proj, param, shard in projections]
