"""A pitfall of decode steps replayed as CUDA graphs (``tplab.engine.static_decode``): not from the review notes."""
from tplab.engine.static_decode import StaticDecode


class StaleInputsDecode(StaticDecode):
    """Copies each step's token ids, context lengths and block tables into the graph's buffers, but the
    positions and ``slot_mapping`` only the first time a bucket runs, when its graph is captured.

    Where it comes from: a graph replays the kernels it recorded on the addresses it recorded, so it reads
    whatever those buffers hold now. Code that builds a step's positions as a fresh tensor (as an eager step
    does), or fills only the inputs it thinks change, hands the replay the values those buffers last held:
    here, the bucket's first step's. That step is right (its values were there at capture); every later step
    of the bucket rotates its token at that first position and writes its K/V over that one slot: wrong
    tokens, no error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.filled: set[tuple[int, int]] = set()

    def copy_inputs(self, seqs, n: int, w: int) -> None:
        values = self.step_inputs(seqs, n, w)
        if (n, w) in self.filled:                     # "its graph already has them"
            del values["positions"], values["slot_mapping"]
        self.filled.add((n, w))
        self.write(values, n, w)
