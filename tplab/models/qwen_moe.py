"""Qwen2-MoE and Qwen3-MoE, tensor and expert parallel: Qwen2 (and Qwen3's attention) with a sparse MoE
block in place of the MLP in the layers HF makes sparse.

Per MoE block on each rank (T tokens, hidden size E, X experts, top k; ``tplab.layers.moe``):
    x (T, E) -> gate (replicated) -> router_logits (T, X)
             -> experts (Parts.experts): each token through its k experts, weighted -> this rank's partial sum (T, E)
             (Qwen2-MoE) + sigmoid(shared_expert_gate(x)) (T, 1) * shared_expert(x): a TP-split MLP's partial sum
             -> one all-reduce (T, E)      (under sequence parallelism: the partial sums, reduce-scattered by the layer)
As vLLM does, the experts and the shared expert are summed on each rank and reduced once. The shared expert
is split by TP in both placements; the router and the shared expert's gate are whole on every rank. Under data
parallelism (``data_parallel_size``) the experts are spread over every rank and the tokens travel to them by
all-to-all (``FusedMoE.forward_all_to_all``); the shared expert stays within the DP rank's TP group, and a DP
rank with nothing to run joins the exchanges with no tokens (``dummy_forward``).

A layer is sparse as HF decides (``is_moe_layer``): not in ``mlp_only_layers``, and ``(i + 1)`` a multiple of
``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``. The checkpoint names every
expert's tensors (``mlp.experts.3.gate_proj.weight``, as the Hub's files do); the loader stacks them into
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (HF's own names in memory) through
``expert_params_mapping``.
"""
import torch
from torch import nn

from tplab.distributed.parallel_state import all_reduce, dp_rank_and_size
from tplab.layers.linear import returns_partial_sums
from tplab.layers.moe import ReplicatedLinear, make_expert_params_mapping
from tplab.models.qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2MLP
from tplab.models.qwen3 import Qwen3Attention


def is_moe_layer(config, layer_idx: int) -> bool:
    """HF's rule for which layers hold the sparse MoE block (the others a dense MLP)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeSparseMoeBlock(nn.Module):
    """The MoE block of one layer: ``gate`` (the router), ``experts``, and Qwen2-MoE's ``shared_expert`` with
    its ``shared_expert_gate`` (where the config has ``shared_expert_intermediate_size``; Qwen3-MoE has none).
    ``forward``: ``(T, E) -> (T, E)``, all-reduced; under sequence parallelism this rank's partial sum."""

    def __init__(self, config, parts, tp_rank: int, tp_size: int, sequence_parallel: bool = False,
                 enable_expert_parallel: bool = False):
        super().__init__()
        self.tp_size, self.sequence_parallel = tp_size, sequence_parallel
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        dp_rank, dp_size = dp_rank_and_size()       # under data parallelism the experts part is told (else not)
        data_parallel = {"dp_rank": dp_rank, "dp_size": dp_size} if dp_size > 1 else {}
        self.experts = parts.experts(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                                     reduce_results=False, tp_rank=tp_rank, tp_size=tp_size,
                                     enable_expert_parallel=enable_expert_parallel, **data_parallel)
        # The shared expert's partial sum joins the experts' before the one all-reduce where its down_proj can
        # hand one back (a ReturnsPartialSums row_linear); another row_linear reduces it, and it is added after.
        self.shared_partial = sequence_parallel or returns_partial_sums(parts.row_linear)
        shared_size = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = self.shared_expert_gate = None
        if shared_size:
            self.shared_expert = Qwen2MLP(config, parts, tp_rank, tp_size, partial_sums=self.shared_partial,
                                          intermediate_size=shared_size)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))                        # (T, E): this rank's partial sum
        shared = None
        if self.shared_expert is not None:                         # HF: sigmoid(gate(x)) * shared_expert(x)
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)   # (T, 1) * (T, E)
            if self.shared_partial:
                out, shared = out + shared, None
        if not self.sequence_parallel:                             # SP: the layer reduce-scatters the partial sums
            out = all_reduce(out, self.tp_size)
        return out if shared is None else out + shared


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    def make_mlp(self, config, parts, tp_rank, tp_size, sequence_parallel, layer_idx, enable_expert_parallel):
        if not is_moe_layer(config, layer_idx):                    # a dense layer (mlp_only_layers, sparse step)
            return Qwen2MLP(config, parts, tp_rank, tp_size, partial_sums=sequence_parallel)
        return Qwen2MoeSparseMoeBlock(config, parts, tp_rank, tp_size, sequence_parallel, enable_expert_parallel)


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention = Qwen3Attention


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """One rank's shard of a Qwen2-MoE model (``model_type`` ``qwen2_moe``). ``enable_expert_parallel``:
    each of the ranks (``dp_size x tp_size``) holds ``num_experts / (dp_size x tp_size)`` whole experts instead
    of every expert split by TP."""
    decoder_layer = Qwen2MoeDecoderLayer

    def __init__(self, config, parts, tp_rank: int | None = None, tp_size: int | None = None,
                 sequence_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1,
                 enable_expert_parallel: bool = False):
        super().__init__(config, parts, tp_rank, tp_size, sequence_parallel, pp_rank, pp_size, enable_expert_parallel)
        self.expert_params_mapping = make_expert_params_mapping(config.num_experts)

    def dummy_forward(self) -> None:
        """A step of a data-parallel rank with nothing to run (vLLM's dummy batch): every MoE layer's experts on
        zero tokens, in layer order, so that the exchanges of the ranks with tokens find this rank there. Nothing
        else in a layer crosses DP ranks (attention, the shared expert and their all-reduces stay in the TP group,
        whose ranks are all idle together), so nothing else runs."""
        for i in self.stage.layers:
            if is_moe_layer(self.config, i):
                block = self.model.layers[i].mlp
                x = block.gate.weight.new_empty(0, self.config.hidden_size)       # (0, E)
                block.experts(x, block.gate(x))

    @classmethod
    def tp_split_sizes(cls, config, enable_expert_parallel: bool = False) -> dict[str, int]:
        sparse = [is_moe_layer(config, i) for i in range(config.num_hidden_layers)]
        sizes = {} if all(sparse) else {"intermediate_size": config.intermediate_size}
        if any(sparse):
            if enable_expert_parallel:                             # whole experts: X / (d t) on each rank
                sizes["num_experts"] = config.num_experts
            else:                                                  # every expert split by TP
                sizes["moe_intermediate_size"] = config.moe_intermediate_size
            if getattr(config, "shared_expert_intermediate_size", 0):
                sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        return sizes


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """One rank's shard of a Qwen3-MoE model (``model_type`` ``qwen3_moe``): Qwen3's attention, no shared expert."""
    decoder_layer = Qwen3MoeDecoderLayer
