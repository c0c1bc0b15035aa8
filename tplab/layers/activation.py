"""SiLU-gated MLP activation on a fused gate|up projection."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``(T, 2 * I_local) -> (T, I_local)``: ``silu(gate) * up`` on this rank's shard of each (``I / tp_size`` columns)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
