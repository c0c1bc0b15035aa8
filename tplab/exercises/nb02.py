"""Notebook 02 (column and row sharding): cut one rank's shard out of an ``nn.Linear.weight``.

``shard(weight, rank, tp, kind)``: ``weight`` is ``(out_features, in_features)``; ``kind`` is
``"column"`` (split dim 0, the outputs: each rank computes a slice of y) or ``"row"`` (split
dim 1, the inputs: each rank produces a partial sum). Returns rank ``rank``'s ``(out / tp, in)``
or ``(out, in / tp)`` piece. Checked against the weights tplab's ``ColumnParallelLinear`` and
``RowParallelLinear`` hold after their ``weight_loader`` has narrowed the same tensor.
"""
import torch

from tplab.exercises import not_a_tensor, run_checker
from tplab.layers.linear import ColumnParallelLinear, RowParallelLinear

OUT_FEATURES, IN_FEATURES = 12, 8       # not square, so a transposed or swapped shard shows in its shape
TP_SIZES = (1, 2, 4)
LAYERS = {"column": ColumnParallelLinear, "row": RowParallelLinear}


def checker_weight() -> torch.Tensor:
    """The fixed ``(out_features, in_features)`` weight the checker shards: entry (i, j) is ``i + j / 100``,
    so a number tells its row and column."""
    rows = torch.arange(OUT_FEATURES, dtype=torch.float32)[:, None]
    cols = torch.arange(IN_FEATURES, dtype=torch.float32)[None, :]
    return rows + cols / 100


def reference_shard(weight: torch.Tensor, rank: int, tp: int, kind: str) -> torch.Tensor:
    """The weight tplab's layer of ``kind`` holds on ``rank`` after loading ``weight``."""
    out_features, in_features = weight.shape
    layer = LAYERS[kind](in_features, out_features, bias=False, tp_rank=rank, tp_size=tp)
    layer.weight.weight_loader(layer.weight, weight)
    return layer.weight.data


def _diagnose(mine: torch.Tensor, ref: torch.Tensor, weight: torch.Tensor, rank: int, tp: int, kind: str) -> str:
    where = f"{kind} shard, rank {rank} of tp {tp}"
    other = "row" if kind == "column" else "column"
    if torch.equal(mine, reference_shard(weight, rank, tp, other)):
        dim, right = (1, 0) if kind == "column" else (0, 1)
        return (f"{where}: this is the {other} shard (dim {dim}); nn.Linear.weight is (out_features, "
                f"in_features), so a {kind}-parallel layer splits dim {right}")
    dim = 0 if kind == "column" else 1
    if tuple(mine.shape) == tuple(ref.shape)[::-1] and torch.equal(mine.T, ref):
        return f"{where}: transposed; return the shard in the weight's own (out_features, in_features) layout, no .T"
    if tp > 1 and torch.equal(mine, weight):
        return f"{where}: the whole weight; each rank keeps 1 / tp of dim {dim}"
    strided = weight[rank::tp] if kind == "column" else weight[:, rank::tp]
    if tp > 1 and torch.equal(mine, strided):
        return (f"{where}: every tp-th {'row' if dim == 0 else 'column'} (a stride of tp); a shard is one "
                f"contiguous block, [rank * size, (rank + 1) * size) of dim {dim}, size = weight.shape[{dim}] // tp")
    other_rank = next((o for o in range(tp) if o != rank and torch.equal(mine, reference_shard(weight, o, tp, kind))),
                      None)
    if other_rank is not None:
        return (f"{where}: this is rank {other_rank}'s shard; rank r's starts at r * size of dim {dim} (ranks count "
                "from 0)")
    if tuple(mine.shape) != tuple(ref.shape):
        return (f"{where}: shape {tuple(mine.shape)}, tplab's layer holds {tuple(ref.shape)}: dim {dim} is cut in tp "
                f"pieces of weight.shape[{dim}] // tp = {weight.shape[dim] // tp}, the other dim kept whole")
    if kind == "column":
        cols = weight.shape[1] // tp                     # the student's loader: narrow dim 1, reshape to fit
        if torch.equal(mine, weight.narrow(1, rank * cols, cols).reshape(ref.shape)):
            return (f"{where}: input columns reshaped into the shard's rows (the student's shard_dim1 bug): "
                    "the shape fits, the numbers belong to other outputs; narrow dim 0")
    i, j = (int(x) for x in (mine != ref).nonzero()[0])
    return (f"{where}: entry ({i}, {j}) is {float(mine[i, j]):.2f}, expected {float(ref[i, j]):.2f} "
            "(the checker's entry (i, j) is i + j / 100: whole part = row, decimals = column of the full weight)")


def _call(fn, weight, rank, tp, kind):
    """``fn``'s shard, or the message for the error it raised (the stub's NotImplementedError goes on up)."""
    try:
        return fn(weight.clone(), rank, tp, kind), None
    except NotImplementedError:
        raise
    except Exception as e:
        past = ": past the end of the weight; rank r's shard starts at r * size (ranks count from 0), so the " \
               "last one ends at the dimension's full size" if "exceeds dimension size" in str(e) else ""
        return None, f"{kind} shard, rank {rank} of tp {tp}: raised {type(e).__name__}: {e}{past}"


def _compare(fn):
    weight, count = checker_weight(), 0
    for kind in ("column", "row"):
        for tp in TP_SIZES:
            for rank in range(tp):
                mine, error = _call(fn, weight, rank, tp, kind)
                if error:
                    return False, error
                wrong = not_a_tensor(mine)
                if wrong:
                    return False, wrong
                ref = reference_shard(weight, rank, tp, kind)
                if mine.dtype != ref.dtype:
                    return False, (f"{kind} shard, rank {rank} of tp {tp}: {mine.dtype}, but the weight is "
                                   f"{ref.dtype} and the layer's parameter too: cut the shard out of the weight "
                                   "as it is (narrow or slicing keep its dtype)")
                if not torch.equal(mine, ref):
                    return False, _diagnose(mine, ref, weight, rank, tp, kind)
                count += 1
    return True, (f"equal to ColumnParallelLinear / RowParallelLinear loaded weights: {count} shards of a "
                  f"({OUT_FEATURES}, {IN_FEATURES}) weight at tp {', '.join(map(str, TP_SIZES))}")


def check_shard(fn):
    """Compare ``fn(weight, rank, tp, kind)`` with tplab's column and row parallel layers' loaded shards."""
    return run_checker("shard", fn, _compare)
