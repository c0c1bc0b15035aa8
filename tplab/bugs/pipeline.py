"""Pipeline-parallel pitfalls (``LLM(..., pipeline_parallel_size=p)``), each a ``Parts.pipeline_stage`` that
gets one thing wrong: what crosses a stage boundary, and which layers a stage keeps a KV cache for."""
import torch

from tplab.distributed.parallel_state import isend, recv
from tplab.models.pipeline import PipelineStage


class ResidualNotSentStage(PipelineStage):
    """Only the hidden state crosses the stage boundary: the next stage starts from it alone.

    Where it comes from: a decoder layer ends in ``residual + mlp(...)``, and code that moves the residual add
    into the next layer's norm (vLLM's fused add-RMSNorm does) hands the next stage two tensors, the MLP's
    output and the residual. Sending only the first one, as one would send "the activation", drops the whole
    residual stream: the embedding and every earlier layer's contribution. Nothing raises and the shapes are
    right; the first layer of the second stage reads a wrong input, so every activation from there on is
    off (by far more than the bound) and the greedy tokens part from HF's at once. At PP 1 nothing crosses
    and it is exact."""

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        for request in self._sending:
            request.wait()
        self._sending = [isend(hidden, self.peer(self.pp_rank + 1))]        # the residual stays behind

    def recv(self, rows, hidden_size, dtype, device):
        hidden = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), self.peer(self.pp_rank - 1))
        return hidden, torch.zeros_like(hidden)                             # as if the residual were zero


class KVEveryLayerStage(PipelineStage):
    """Every stage allocates a KV cache for every layer of the model, not only for its own.

    Where it comes from: the KV cache is sized from ``num_hidden_layers`` in the config, which is the model's
    and not the stage's. The numbers are right (a stage only ever reads and writes its own layers' caches,
    so greedy tokens equal HF's), and memory is not: each stage holds ``p`` times the cache it uses for
    layers that run elsewhere (``llm.stats()["kv_cache_bytes"]``), and from a memory budget it gets ``p``
    times fewer blocks, so fewer sequences run at once."""

    @property
    def kv_cache_layers(self) -> range:
        return range(self.num_layers)
