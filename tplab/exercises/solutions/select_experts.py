# Exercise: select_experts (reference solution)
import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """(T, X) router logits -> each token's top_k experts: weights (T, k) in the logits' dtype, ids (T, k)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)   # over all X experts, in fp32
    weights, ids = torch.topk(probs, top_k, dim=-1)                      # (T, k) each, largest first
    if renormalize:                                                      # norm_topk_prob: the k weights sum to 1
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids
