# Exercise: lm_head (reference solution)
import torch
from torch import nn

from tplab.distributed.parallel_state import all_gather, tp_rank_and_size
from tplab.layers import copy_into


class MyParallelLMHead(nn.Module):
    """logits = hidden @ W.T with W's vocabulary rows split as the embedding's: each rank computes
    the logits of its rows, an all-gather concatenates them, and the padding is dropped."""

    def __init__(self, num_embeddings, embedding_dim, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        real = max(0, min(self.per_rank, self.num_embeddings - self.start))
        copy_into(param.data[:real], loaded.narrow(0, self.start, real))

    def forward(self, hidden):                                      # (N, E)
        logits = hidden @ self.weight.T                             # (N, per_rank): this rank's vocabulary
        logits = all_gather(logits, self.tp_size, dim=-1)           # (N, per_rank * tp), in rank order
        return logits[:, : self.num_embeddings]                     # (N, vocab): padding dropped
