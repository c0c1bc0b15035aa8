# Exercise: moe_dispatch (reference solution)
import torch

from tplab.distributed.parallel_state import all_to_all, ep_all_gather


def moe_dispatch(x, ids, num_experts, ep_rank, ep_size):
    """Each (token, expert) pair's row of x (T_r, E) to the rank that holds its expert; ids (T_r, k) global."""
    top_k, per_rank = ids.shape[1], num_experts // ep_size       # rank r holds experts r * per_rank ...
    order = ids.flatten().argsort(stable=True)                   # (T_r k,) pairs by expert: by destination rank
    counts = torch.bincount(ids.flatten(), minlength=num_experts)   # (X,) this rank's pairs per expert
    every = ep_all_gather(counts, ep_size)                       # (ep_size, X): every rank's counts, on every rank
    plan = every.view(ep_size, ep_size, per_rank)                # [source, destination, local expert]
    traffic = plan.sum(-1).tolist()                              # traffic[i][j]: rows rank i sends rank j
    received = all_to_all(x[order // top_k], traffic)            # (R, E): grouped by source, then by expert
    mine = plan[:, ep_rank]                                      # (ep_size, per_rank): rows from each source
    local = torch.arange(per_rank).repeat(ep_size).repeat_interleave(mine.flatten())   # (R,) 0 .. per_rank - 1
    return received, local, order, traffic
