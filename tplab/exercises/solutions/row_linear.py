# Exercise: row_linear (reference solution)
import torch
from torch import nn

from tplab.distributed.parallel_state import all_reduce, tp_rank_and_size
from tplab.layers import copy_into


class MyRowParallelLinear(nn.Module):
    """o_proj and down_proj: W (output_size, input_size) split on dim 1, the inputs. Each rank
    multiplies its slice of the features by its columns of W: a partial sum, completed by one
    all-reduce. The bias is added once, on rank 0, before the sum."""

    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size, self.output_size = input_size, output_size
        cols = input_size // self.tp_size                           # this rank's input features
        self.weight = nn.Parameter(torch.empty(output_size, cols), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:                                                    # one bias for the whole output: not split
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:                                        # the bias: every rank keeps all of it
            copy_into(param.data, loaded)
            return
        cols = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.tp_rank * cols, cols))   # (output_size, input_size / tp)

    def forward(self, x):                                           # x (T, input_size / tp): this rank's slice
        y = x @ self.weight.T                                       # (T, output_size): a partial sum
        if self.bias is not None and self.tp_rank == 0:
            y = y + self.bias                                       # once, not tp_size times
        return all_reduce(y, self.tp_size)                          # (T, output_size): the full sum, every rank
