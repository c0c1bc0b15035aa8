# Exercise: embedding (reference solution)
import torch
from torch import nn

from tplab.distributed.parallel_state import all_reduce, tp_rank_and_size
from tplab.layers import copy_into


class MyVocabParallelEmbedding(nn.Module):
    """The vocabulary (dim 0 of the table) padded to a multiple of tp_size and split: rank r owns
    rows [r * per_rank, (r + 1) * per_rank). It looks up the ids it owns, writes zeros for the
    others, and an all-reduce adds the ranks' lookups into the full embedding."""

    def __init__(self, num_embeddings, embedding_dim, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)         # ceil: padding included
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        real = max(0, min(self.per_rank, self.num_embeddings - self.start))   # rows past the vocab stay 0
        copy_into(param.data[:real], loaded.narrow(0, self.start, real))

    def forward(self, input_ids):                                   # (T,) ids of the whole vocabulary
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)               # the ids this rank owns
        y = self.weight[local.masked_fill(~mine, 0)]                # (T, E): a valid row for every id...
        y = y.masked_fill(~mine[:, None], 0.0)                      # ...zeroed where the id is not ours
        return all_reduce(y, self.tp_size)                          # (T, E): each id's row, from its owner
