"""The experts' exchange under data parallelism: tokens to their experts' ranks and back, by all-to-all.

With d DP ranks of t TP ranks each, the X experts are spread over all d t ranks (X / (d t) whole experts
each), and each DP rank has tokens of its own. Per MoE layer and step, on every rank
(``FusedMoE.forward_all_to_all``):
    this TP rank's 1/t of its DP rank's tokens -> (token, expert) pairs sorted by expert = by owner rank
    counts (X,) all-gathered -> everyone knows who sends whom how many rows (the traffic matrix)
    all-to-all: each pair's x to its expert's rank (dispatch) -> the expert MLPs -> all-to-all back (combine)
    out[its tokens] += weight * y, in fp32; the other rows stay 0, and the block's TP all-reduce fills them.
The dispatch and the combine are the parts ``Parts.moe_dispatch`` and ``Parts.moe_combine`` (notebook 08's
exercises), handed to ``FusedMoE`` as ``dispatch=`` and ``combine=``.
"""
import torch

from tplab.distributed.parallel_state import all_to_all, ep_all_gather


def all_to_all_dispatch(x: torch.Tensor, ids: torch.Tensor, num_experts: int, ep_rank: int, ep_size: int):
    """The dispatch (``Parts.moe_dispatch``), on each of the ``ep_size`` ranks: each (token, expert) pair's row of
    ``x`` ``(T_r, E)`` to the rank that holds the expert, ``ids`` ``(T_r, k)`` (global ids; rank r holds experts
    ``r X / ep_size .. (r + 1) X / ep_size - 1``). Returns ``(received, local, order, traffic)``: ``received``
    ``(R, E)`` the rows sent to this rank, by source rank then expert; ``local`` ``(R,)`` the local expert of each
    (``0 .. X / ep_size - 1``); ``order`` ``(T_r k,)`` the pairs in the order this rank sent them, as indices into
    ``ids.flatten()``; ``traffic[i][j]`` the rows rank i sent rank j, the same on every rank."""
    top_k, per_rank = ids.shape[1], num_experts // ep_size
    flat = ids.flatten()                                                  # (P,) pair p: token p // k
    order = flat.argsort(stable=True)                                     # by expert, so by the rank that holds it
    counts = torch.bincount(flat, minlength=num_experts)                  # (X,) pairs per expert
    plan = ep_all_gather(counts, ep_size).view(ep_size, ep_size, per_rank)   # [source, destination, local expert]
    traffic = plan.sum(-1).tolist()                                       # known to every rank alike
    received = all_to_all(x.index_select(0, order // top_k), traffic)     # (R, E): by source, then expert
    local = torch.arange(per_rank, device=x.device).repeat(ep_size).repeat_interleave(plan[:, ep_rank].flatten())
    return received, local, order, traffic


def all_to_all_combine(y: torch.Tensor, order: torch.Tensor, traffic: list[list[int]], weights: torch.Tensor):
    """The combine (``Parts.moe_combine``): the experts' outputs ``y`` ``(R, E)`` of the rows the dispatch received,
    back to the ranks that sent them (the traffic transposed), each weighted by its pair's routing weight
    (``weights`` ``(T_r, k)``) and added into its token, in fp32: ``(T_r, E)``."""
    back = all_to_all(y, [list(col) for col in zip(*traffic)])           # (P, E): in the order sent
    out = torch.zeros(weights.shape[0], y.shape[-1], dtype=torch.float32, device=y.device)
    out.index_add_(0, order // weights.shape[1], (back * weights.flatten()[order].unsqueeze(-1)).float())
    return out
