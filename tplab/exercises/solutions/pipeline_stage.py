# Exercise: pipeline_stage (reference solution)
import torch

from tplab.distributed.parallel_state import isend, recv


class MyPipelineStage:
    """Stage pp_rank of pp_size: a contiguous range of the layers on its own tp_size ranks, world rank
    pp_rank * tp_size + tp_rank. The first stage also embeds, the last also norms and samples."""

    def __init__(self, num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1):
        self.num_layers, self.pp_rank, self.pp_size = num_layers, pp_rank, pp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        base, extra = divmod(num_layers, pp_size)                   # the first `extra` stages get one more layer
        start = pp_rank * base + min(pp_rank, extra)
        self.layers = range(start, start + base + (pp_rank < extra))
        self.has_embedding, self.has_head = pp_rank == 0, pp_rank == pp_size - 1
        self.kv_cache_layers = self.layers                          # a KV cache for its own layers only
        self._sending = []

    def peer(self, pp_rank):                                        # the same TP rank in stage pp_rank
        return pp_rank * self.tp_size + self.tp_rank

    def send(self, hidden, residual):                               # both (rows, E): the stage's last layer
        for request in self._sending:                               # the previous pair has left
            request.wait()
        self._sending = [isend(hidden, self.peer(self.pp_rank + 1)), isend(residual, self.peer(self.pp_rank + 1))]

    def recv(self, rows, hidden_size, dtype, device):               # -> (hidden, residual), in the order sent
        hidden = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), self.peer(self.pp_rank - 1))
        residual = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), self.peer(self.pp_rank - 1))
        return hidden, residual
