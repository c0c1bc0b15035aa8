"""Pipeline parallelism: the model's layers split into ``pipeline_parallel_size`` stages, one after another.

Stage s holds a contiguous range of the decoder layers on its own ``tensor_parallel_size`` ranks (world ranks
``s * t .. s * t + t - 1``); the first stage also holds the embedding, the last the final norm and the LM
head. A stage reads only its own tensors from the checkpoint and keeps a KV cache only for its own layers.
Between stages crosses what vLLM sends (its ``IntermediateTensors``): the last layer's MLP output before its
residual add (``hidden``) and the residual stream it is added to (``residual``), ``(T, E)`` each; the next
stage starts from ``residual + hidden``, the very sum the layer would have made. Each TP rank sends its copy
to the same TP rank of the next stage (under sequence parallelism, its own T / t tokens of each).

A layer another stage owns is a ``PPMissingLayer`` (vLLM's name): no parameters, so this stage's parameter
names keep their global layer index (``model.layers.7.mlp...``) and match the checkpoint's.

``PipelineStage`` is the part (``Parts.pipeline_stage``) that says which layers a stage owns and carries the
boundary; ``tplab.engine.pipeline_loop`` runs the stages with several batches in flight.
"""
import torch
from torch import nn

from tplab.distributed.parallel_state import isend, recv


class PPMissingLayer(nn.Identity):
    """The place of a module another pipeline stage owns: no parameters, never called."""


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers of stage ``pp_rank``: ``num_layers // pp_size`` each, and the first ``num_layers % pp_size``
    stages one more. The remainder goes to the front because the last stage also runs the final norm, the LM
    head (a matmul over the whole vocabulary: on a small model the largest of a step) and the sampler."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


class PipelineStage:
    """One pipeline stage: which layers it owns, and the boundary to its neighbours.

    Contract of ``Parts.pipeline_stage`` (what a replacement keeps):
    - ``__init__(num_layers, pp_rank, pp_size, tp_rank=0, tp_size=1)``; world rank = ``pp_rank * tp_size + tp_rank``
      (within its DP rank: ``parallel_state``'s ``isend``/``recv`` add the DP rank's first world rank).
    - ``pp_rank``, ``pp_size``: attributes the engine reads.
    - ``layers``: the global indices of the decoder layers this stage owns, a non-empty ``range``; the stages'
      ranges are contiguous, in order, and cover ``range(num_layers)`` once.
    - ``has_embedding`` (the first stage) / ``has_head`` (the last: final norm and LM head): bools.
    - ``kv_cache_layers``: the layers this stage allocates a KV cache for (its own: ``layers``).
    - ``send(hidden, residual)``: start sending both ``(rows, E)`` tensors to the same TP rank of the next stage
      and return at once (``isend``): the next stage receives them in its next tick, after this tick ends on
      every rank, so a blocking send (``dist.send``) of a prefill's tensors waits for ever (gloo: until the timeout).
    - ``recv(rows, hidden_size, dtype, device) -> (hidden, residual)``: wait for the previous stage's pair.
    """

    def __init__(self, num_layers: int, pp_rank: int, pp_size: int, tp_rank: int = 0, tp_size: int = 1):
        self.num_layers, self.pp_rank, self.pp_size = num_layers, pp_rank, pp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layers = layer_range(num_layers, pp_rank, pp_size)
        self.has_embedding, self.has_head = pp_rank == 0, pp_rank == pp_size - 1
        self._sending = []                         # the requests of the last send, waited on before the next

    @property
    def kv_cache_layers(self) -> range:
        return self.layers

    def peer(self, pp_rank: int) -> int:
        """World rank of this TP rank in stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        for request in self._sending:              # the previous tick's pair has left: its buffers may go
            request.wait()
        dst = self.peer(self.pp_rank + 1)
        self._sending = [isend(hidden, dst), isend(residual, dst)]

    def recv(self, rows: int, hidden_size: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.peer(self.pp_rank - 1)
        hidden = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), src)    # (rows, E)
        residual = recv(torch.empty(rows, hidden_size, dtype=dtype, device=device), src)  # (rows, E)
        return hidden, residual


def other_stages_names(model: nn.Module, names) -> frozenset[str]:
    """The checkpoint tensor names among ``names`` that belong to modules another stage owns (``PPMissingLayer``):
    the loader skips them. A name this stage reads under another name (``model.weight_aliases``) is kept."""
    prefixes = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
    aliases = getattr(model, "weight_aliases", {})
    return frozenset(n for n in names if n not in aliases and n.startswith(prefixes))
