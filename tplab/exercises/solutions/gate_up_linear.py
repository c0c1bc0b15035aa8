# Exercise: gate_up_linear (reference solution)
import torch
from torch import nn

from tplab.distributed.parallel_state import tp_rank_and_size
from tplab.layers import copy_into


class MyMergedColumnParallelLinear(nn.Module):
    """gate_proj | up_proj fused: each rank keeps its rows of gate and its rows of up, laid out
    [gate rows of this rank | up rows of this rank], so silu(gate) * up pairs up on the rank.
    Column parallel: no communication."""

    def __init__(self, input_size, output_sizes, bias=False, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.local_sizes = [size // self.tp_size for size in output_sizes]   # rows of gate, of up per rank
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id):
        rows = self.local_sizes[shard_id]                           # shard_id 0: gate_proj, 1: up_proj
        offset = sum(self.local_sizes[:shard_id])                   # where this part starts in the fused rows
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x):                                           # x (T, input_size), the same on every rank
        return x @ self.weight.T                                    # (T, 2 * I / tp): gate | up of this rank
