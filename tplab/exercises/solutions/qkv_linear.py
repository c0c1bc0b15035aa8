# Exercise: qkv_linear (reference solution)
import torch
from torch import nn

from tplab.distributed.parallel_state import tp_rank_and_size
from tplab.layers import copy_into


class MyQKVParallelLinear(nn.Module):
    """q_proj | k_proj | v_proj fused, split by attention head: this rank's query heads, and the KV
    heads they attend with. With more ranks than KV heads, each KV head is replicated on
    tp_size / total_num_kv_heads neighbouring ranks."""

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=True,
                 tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_heads = total_num_heads // self.tp_size
        self.num_kv_heads = max(1, total_num_kv_heads // self.tp_size)
        self.replicas = max(1, self.tp_size // total_num_kv_heads)  # ranks that share one KV head
        self.q_size, self.kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        rows = self.q_size + 2 * self.kv_size                       # [q | k | v] of this rank
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id):
        if shard_id == "q":
            rows, offset, start = self.q_size, 0, self.tp_rank * self.q_size
        else:                                                       # "k" or "v": the KV group of this rank
            rows = self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = (self.tp_rank // self.replicas) * self.kv_size
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))

    def forward(self, x):                                           # x (T, hidden_size)
        y = x @ self.weight.T                                       # (T, q_size + 2 kv_size)
        return y + self.bias if self.bias is not None else y
