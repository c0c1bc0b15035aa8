"""Sequence-parallel pitfalls: the norm region (``Parts.sp_norm_region``) with a mistake that real SP code
makes. They come from what goes wrong when an all-reduce is split into a reduce-scatter and an all-gather,
not from the review notes; each is run with ``LLM(..., sequence_parallel=True)``."""
from tplab.distributed.parallel_state import all_gather, reduce_scatter
from tplab.models.sequence_parallel import SequenceParallelNormRegion


class HiddenScatterNormRegion(SequenceParallelNormRegion):
    """Reduce-scatter on the hidden dimension instead of the tokens.

    What goes wrong in SP code: the column-parallel habit ("split the features") carried over to the
    reduce-scatter, ``reduce_scatter(partial, tp_size, dim=-1)``. Each rank gets the summed (T_pad, E / t)
    slice of every token's features; reshaped to the (T_pad / t, E) the residual expects, the element
    counts agree and nothing raises, but each row is made of pieces of t different tokens. The embedding's
    lookups go through the same scatter, so the residual stream is scrambled before the first layer: the
    per-sublayer diff shows layer 0's input_layernorm as the first to differ, by the size of the
    activations, with every number in it a right number in the wrong place."""

    def add(self, partial, residual=None):
        summed = reduce_scatter(self._pad(partial), self.tp_size, dim=-1)    # (T_pad, E / t): the wrong split
        summed = summed.reshape(-1, partial.shape[-1])                       # forced into (T_pad / t, E)
        return summed if residual is None else residual + summed


class NormTwiceNormRegion(SequenceParallelNormRegion):
    """The norm applied to this rank's tokens, and again to the gathered tokens.

    What goes wrong in SP code: the norm moves into the sequence-parallel region (before the all-gather),
    and the layer's old ``self.input_layernorm(x)`` call stays where plain TP had it, after the gather. With
    y = norm(x) = w * x / rms(x), norm(y) = w * y / rms(y) = w * w * x / rms(w * x): y again only when the
    weight w is all ones. So the first activation that differs is layer 0's input_layernorm, and what it holds
    is exactly HF's input_layernorm output normed once more; a checkpoint whose norm weights are all ones
    (a freshly initialised model) hides the mistake."""

    def norm_gather(self, x, norm):
        gathered = all_gather(norm(x), self.tp_size, dim=0)[:self.num_tokens]   # (T, E), normed once
        return norm(gathered)                                                   # ...and once more
