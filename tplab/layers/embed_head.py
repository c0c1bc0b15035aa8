"""Vocabulary-parallel embedding and LM head: the vocab (dim 0 of both weights) is split over ranks.

A vocab that does not divide by tp_size is padded up to the next multiple; the padding rows are zeros,
and the LM head drops their logits when it gathers the vocabulary (``ParallelLMHead.gather``).
"""
import torch
import torch.nn.functional as F
from torch import nn

from tplab.layers.linear import ReturnsPartialSums
from tplab.layers.linear_method import UsesLinearMethod
from tplab.layers.weights import copy_into, expect_shape
from tplab.distributed.parallel_state import all_gather, all_reduce, cdiv, tp_rank_and_size


class VocabShard(nn.Module):
    """This rank's rows of a ``(num_embeddings, embedding_dim)`` weight split by vocabulary: rank r holds rows
    ``[r * per_rank, (r + 1) * per_rank)`` of the table padded to ``per_rank * tp_size`` rows, zeros past the
    real vocabulary. What the embedding and the LM head share."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank=None, tp_size=None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = cdiv(num_embeddings, self.tp_size)          # ceil: the padded vocab / tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.num_real_rows = max(0, min(self.per_rank, num_embeddings - self.vocab_start))
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        expect_shape(loaded, (self.num_embeddings, self.embedding_dim))
        param.data.zero_()  # padding rows stay zero
        n = self.num_real_rows
        copy_into(param.data[:n], loaded.narrow(0, self.vocab_start, n))


class VocabParallelEmbedding(VocabShard, ReturnsPartialSums):
    """Each rank looks up the ids that fall in its rows, writes zeros for the others,
    and an all-reduce sums the ranks' partial lookups into the full embedding (``reduce_results=False``:
    the caller sums them; sequence parallelism reduce-scatters them over tokens).

    Contract of ``Parts.embedding`` (what a replacement keeps):
    - ``__init__(num_embeddings, embedding_dim, tp_rank=None, tp_size=None)``: the full vocabulary size.
    - ``weight``: this rank's ``(ceil(num_embeddings / tp_size), embedding_dim)`` rows (zeros past the
      real vocabulary), with ``weight.weight_loader``. A tied LM head uses this same tensor.
    - ``weight_loader(param, loaded, shard_id=None)``: ``loaded`` is the full ``(num_embeddings,
      embedding_dim)`` checkpoint tensor, or a lazy slice of it.
    - ``forward(input_ids)``: ``(T,)`` token ids of the whole vocabulary -> ``(T, embedding_dim)``, the
      same full embeddings on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank=None, tp_size=None,
                 reduce_results: bool = True):
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def lookup_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial lookup ``(T, hidden)``: its own rows, zeros for ids it does not hold."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.per_rank)               # ids this rank owns
        y = F.embedding(local.masked_fill(~mine, 0), self.weight)   # (T, hidden)
        return y.masked_fill(~mine.unsqueeze(-1), 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        partial = self.lookup_local(input_ids)                      # (T, hidden), zeros for ids of other ranks
        return all_reduce(partial, self.tp_size) if self.reduce_results else partial


class ParallelLMHead(VocabShard, UsesLinearMethod):
    """``logits = hidden @ W.T`` with W split by vocab rows; an all-gather assembles the full vocab.

    Every rank gets the full logits, so every rank can sample the same token from
    the same seeded generator with no extra broadcast. The product goes through ``self.linear_method``
    (``tplab.layers.linear_method``), which must leave ``weight`` readable: it is usually the embedding's.

    Contract of ``Parts.lm_head`` (what a replacement keeps):
    - ``__init__(num_embeddings, embedding_dim, tp_rank=None, tp_size=None)``, as the embedding.
    - ``weight``: this rank's ``(ceil(num_embeddings / tp_size), embedding_dim)`` vocabulary rows, with
      ``weight.weight_loader`` (as the embedding's). With ``tie_word_embeddings`` the model replaces
      it by the embedding part's ``weight``.
    - ``forward(hidden)``: ``(N, embedding_dim) -> (N, num_embeddings)``: the full logits on every
      rank, the padding's columns dropped (``gather_output=False``: this rank's ``(N, per_rank)``, its
      padding included).
    """

    def forward(self, hidden: torch.Tensor, gather_output: bool = True) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden)             # (N, per_rank)
        return self.gather(logits) if gather_output else logits

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(N, per_rank)`` logits -> the full ``(N, vocab)``, the padding's columns dropped."""
        logits = all_gather(logits, self.tp_size, dim=-1)           # (N, per_rank * tp_size)
        return logits[..., : self.num_embeddings]

