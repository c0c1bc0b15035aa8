"""Mixture-of-experts pitfalls (notebook 08), each a part with one mistake that real MoE serving code makes: the
router's weights, which expert a rank's local index means, and the shared expert's sum. They come from spreading
experts over ranks, not from the review notes; each shows as the first MoE block off against HF (``model.layers.0.mlp``
on the workbook's models), at the TP size or placement where it bites."""
import torch

from tplab.layers.linear import RowParallelLinear
from tplab.layers.moe import FusedMoE


class NotRenormalizedMoE(FusedMoE):
    """The top-k weights left as the softmax gave them, whatever ``norm_topk_prob`` says.

    Where it comes from: Mixtral-style routers take the top k of the softmax and renormalise them to sum to 1;
    DeepSeek's and Qwen2-MoE's (``norm_topk_prob: false``) do not. Code written for one family and run on the
    other drops (or adds) the division. With ``norm_topk_prob: true`` (Qwen3-MoE, the workbook's trained model)
    each token's k weights then sum to less than 1, so every MoE block's output is scaled down by that sum, a
    different factor for every token: the first MoE block differs from HF at any TP size, TP 1 included, and a
    checkpoint whose config says ``norm_topk_prob: false`` hides it."""

    def select_experts(self, router_logits: torch.Tensor, dtype: torch.dtype):
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)   # (T, X)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                 # (T, k): never divided by their sum
        return weights.to(dtype), ids


class GlobalIdsMoE(FusedMoE):
    """A rank's local expert index used where the global expert id belongs, under expert parallelism.

    Where it comes from: with ``enable_expert_parallel`` rank r holds experts ``r X / t .. (r + 1) X / t - 1``,
    stacked at local indices ``0 .. X / t - 1``; the router's ids are global. Code that picks the tokens of local
    expert ``e`` with ``ids == e`` (the index it loops over) instead of ``ids == r X / t + e`` is right on rank 0
    and whenever every rank holds every expert (TP 1, TP inside each expert), so it passes those tests; under
    expert parallelism rank 1 runs the tokens routed to experts ``0 .. X / t - 1`` through its own experts, and
    the tokens of its own experts are not run at all. The first MoE block differs from HF by the size of its
    output, at TP 2 with ``enable_expert_parallel=True`` only. Under data parallelism the received tokens go
    through ``run_received``, which this part leaves as it is: there it changes nothing."""

    def rows_by_expert(self, ids: torch.Tensor):
        for local, _ in enumerate(self.local_experts):
            rows, slots = (ids == local).nonzero(as_tuple=True)     # the local index, compared with global ids
            if rows.numel():
                yield local, rows, slots


class SharedExpertEveryRankLinear(RowParallelLinear):
    """A row-parallel ``down_proj`` that always all-reduces, even when its caller asks for the partial sum.

    Where it comes from: an MoE block with a shared expert (Qwen2-MoE, DeepSeek) adds the shared expert's output
    to the routed experts' partial sums and all-reduces once (vLLM, tplab). Code that builds the shared expert
    as a dense MLP, whose ``down_proj`` all-reduces on its own, and then adds it to each rank's partial sum before
    the block's all-reduce counts it ``t`` times: the block's output is HF's plus ``(t - 1)`` times the gated
    shared expert. Exact at TP 1; from TP 2 the first MoE block is off, and only on a model with a shared expert
    (o_proj and dense MLPs ask for their sums, so nothing else changes; not for ``sequence_parallel``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank=None, tp_size=None,
                 reduce_results: bool = True):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)   # reduce_results ignored: always summed
