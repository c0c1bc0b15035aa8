"""What an ``attend`` (``Parts.attend``) may declare, so that ``Attention`` hands it more than one sequence at a
time: a strategy of its own, as a linear layer's ``linear_method`` is (``tplab.layers.linear_method``).

``Attention`` calls a plain ``attend`` function once per sequence (``plain_attend`` is the contract); an
``attend`` that is one of these classes takes the whole step (tplab's own, ``tplab.kernels.attend``), and the
engine prepares what it reads once a step (``decode_inputs``).
"""
import torch
from torch import nn

from tplab.layers.metadata import AttentionMetadata


class AttendsDecodesTogether:
    """An ``attend`` (``Parts.attend``) that takes a whole step, so that it can attend every decode token of
    it at once over the blocks the decode sequences hold (``meta.decode``, which the engine fills with what its
    ``decode_inputs`` makes): ``Attention`` hands it the step (``attend_step``) instead of calling it once per
    sequence, and it hands the sequences it leaves back to ``Attention.attend_each``. A plain function is
    called once per sequence, every sequence."""

    def attend_step(self, layer: nn.Module, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        """q ``(T, H, D)``; ``kv_cache`` the layer's, this step's K/V already written -> ``(T, H, D)``."""
        raise NotImplementedError

    def decode_inputs(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                      block_size: int, device) -> object:
        """What ``attend_step`` reads from ``meta.decode`` (None: nothing). The engine calls it once a step, before
        the forward: on a GPU, a tensor made from host data inside the forward makes the host wait for the queued
        kernels."""
        return None


class AttendsPaddedDecodes(AttendsDecodesTogether):
    """An ``attend`` whose ``attend_step`` also takes a decode step at fixed shapes: ``meta.decode`` a
    ``PaddedDecode`` (``tplab.kernels.decode_blocks``), every row one decode query (the step a CUDA graph
    replays, ``tplab.engine.static_decode``)."""
