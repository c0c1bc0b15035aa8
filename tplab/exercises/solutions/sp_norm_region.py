# Exercise: sp_norm_region (reference solution)
import torch.nn.functional as F

from tplab.distributed.parallel_state import all_gather, reduce_scatter


class MySequenceParallelNormRegion:
    """The sequence-parallel region between a row-parallel layer and the next column-parallel one. Rank r
    holds tokens [r * per_rank, (r + 1) * per_rank) of the step's T tokens padded to per_rank * tp_size."""

    def __init__(self, num_tokens, tp_rank, tp_size):
        self.num_tokens, self.tp_rank, self.tp_size = num_tokens, tp_rank, tp_size
        self.per_rank = -(-num_tokens // tp_size)                   # ceil(T / t): T need not divide
        self.padded = self.per_rank * tp_size

    def pad(self, x):                                               # (T, E) -> (T_pad, E): zero rows at the end
        return F.pad(x, (0, 0, 0, self.padded - x.shape[0]))

    def local(self, full):                                          # (T, E) on every rank -> (per_rank, E)
        return self.pad(full).narrow(0, self.tp_rank * self.per_rank, self.per_rank)

    def add(self, partial, residual=None):                          # (T, E) partial sums -> (per_rank, E)
        summed = reduce_scatter(self.pad(partial), self.tp_size, dim=0)   # summed over ranks, my tokens only
        return summed if residual is None else residual + summed

    def norm_gather(self, x, norm):                                 # (per_rank, E) -> (T, E)
        return all_gather(norm(x), self.tp_size, dim=0)[:self.num_tokens]  # norm my tokens, then gather them
