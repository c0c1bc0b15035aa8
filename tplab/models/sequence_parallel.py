"""Sequence parallelism over the TP ranks (Megatron-LM's, vLLM's sequence-parallel pass over TP).

Plain TP ends every row-parallel layer (o_proj, down_proj) in an all-reduce, and then every rank runs the
residual add and the next RMSNorm on all T tokens: the same work t times. An all-reduce is a reduce-scatter
followed by an all-gather, so the two halves can sit on either side of that token-wise work instead:

    partial sums (T, E) -> reduce-scatter over tokens -> (T/t, E) this rank's tokens
        -> + residual, RMSNorm on T/t tokens -> all-gather over tokens -> (T, E) -> next column-parallel layer

The same bytes cross the link as with the all-reduce; the residual stream and the norms hold and
compute 1/t of the tokens. A step's T tokens are padded to a multiple of t (zero rows, which no
attention sees and which are dropped by every all-gather), so any T works, a single decode included.

``SequenceParallelNormRegion`` is that region, the engine's ``Parts.sp_norm_region``: one is built per
step, ``cls(num_tokens, tp_rank, tp_size)``, and the model calls ``add`` after each row-parallel layer,
``norm_gather`` before each column-parallel one, and ``local`` on an embedding that was all-reduced (it keeps
this rank's tokens; ``tplab.models.qwen2``). A learner's replacement keeps these three methods.
"""
import torch
import torch.nn.functional as F

from tplab.distributed.parallel_state import all_gather, cdiv, reduce_scatter


class SequenceParallelNormRegion:
    """How one step's ``num_tokens`` tokens split over ``tp_size`` ranks: rank r holds rows
    ``[r * per_rank, (r + 1) * per_rank)`` of the tokens padded to ``padded = per_rank * tp_size``."""

    def __init__(self, num_tokens: int, tp_rank: int, tp_size: int):
        self.num_tokens, self.tp_rank, self.tp_size = num_tokens, tp_rank, tp_size
        self.per_rank = cdiv(num_tokens, tp_size)           # ceil(T / t)
        self.padded = self.per_rank * tp_size

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, self.padded - x.shape[0]))  # (T, E) -> (T_pad, E), zero rows at the end

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """``(T, E)``, the same on every rank -> ``(T_pad / t, E)``, this rank's tokens (no communication)."""
        return self._pad(full).narrow(0, self.tp_rank * self.per_rank, self.per_rank)

    def add(self, partial: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``(T, E)`` partial sums of a row-parallel layer (or the embedding's partial lookups) -> their sum
        over ranks on this rank's ``(T_pad / t, E)`` tokens, plus ``residual`` (those tokens) when given."""
        summed = reduce_scatter(self._pad(partial), self.tp_size, dim=0)   # (T_pad / t, E)
        return summed if residual is None else residual + summed

    def norm_gather(self, x: torch.Tensor, norm) -> torch.Tensor:
        """``(T_pad / t, E)`` this rank's residual stream -> ``norm`` on those tokens -> all-gathered in rank
        order, padding dropped: ``(T, E)``, the input of the next column-parallel layer (or the LM head)."""
        return all_gather(norm(x), self.tp_size, dim=0)[:self.num_tokens]
