"""Sharding pitfalls: column-parallel weights cut on the wrong dimension, the fused QKV sized from mixed counts."""
from tplab.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tplab.layers.weights import materialize


class _NarrowsDim1:
    """A checkpoint tensor whose ``narrow(0, start, rows)`` (out_features, right) cuts dim 1 instead.

    The rank takes the same fraction of the *input* columns, ``(out, in * rows / out)``, and forces it
    into its ``(rows, in)`` shard: the element counts agree, so a reshape fits it with no error."""

    def __init__(self, loaded):
        self.loaded, self.shape = loaded, tuple(loaded.shape)

    def narrow(self, dim, start, rows):
        if len(self.shape) == 1:                                    # a bias has no dim 1: sharded right
            return self.loaded.narrow(dim, start, rows)
        full, cols_in = self.shape                                  # (out_features, in_features)
        cols = cols_in * rows // full                               # this rank's fraction, of the wrong dim
        part = materialize(self.loaded.narrow(1, start * cols_in // full, cols))   # (full, cols)
        return part.reshape(rows, cols_in)                          # forced into the (rows, in) shard


class Dim1QKVParallelLinear(QKVParallelLinear):
    """Fused q|k|v whose loader narrows the checkpoint on dim 1 (in_features), not dim 0. ``shard_dim1``
    builds every ``qkv_proj`` from this layer, and every ``gate_up_proj`` from ``Dim1MergedColumnParallelLinear``,
    the MLP's fused gate|up with the same loader.

    Review notes: "你当前的 loader 假设 fused QKV 的格式是 [hidden_size, (Q+K+V)*head_size]，然后按 dim=1 切分
    ... HuggingFace/PyTorch 的 nn.Linear.weight 标准形状是 [out_features, in_features]" (your loader takes
    fused QKV as [hidden_size, (Q+K+V)*head_size] and splits it on dim 1 ... but nn.Linear.weight is
    [out_features, in_features]): a column-parallel layer must cut dim 0, the outputs. At TP 1 a narrow
    takes the whole tensor, so every weight loads exactly and the model matches HF to float32 rounding: the
    mistake hides. At TP 2 each rank holds input columns reshaped into rows: it loads without an error and is
    wrong from the first attention on."""

    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, _NarrowsDim1(loaded), shard_id)


class Dim1MergedColumnParallelLinear(MergedColumnParallelLinear):
    """gate_proj | up_proj narrowed on dim 1, as ``Dim1QKVParallelLinear``.

    Review notes: "并且在 _shard_weight 里也是沿着 dim=1 narrow 来切分" (and _shard_weight narrows on dim 1
    too): the student's shared helper cut dim 1 for every column-parallel weight."""

    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, _NarrowsDim1(loaded), shard_id)


class PresizedQKVParallelLinear(QKVParallelLinear):
    """The student's QKV sizing: local head counts multiplied back by ``tp_size`` and used as global sizes.

    Review notes: "you compute output_size as (num_heads_local + 2*num_kv_heads_local) * tp_size *
    head_size and pass that to ColumnParallelLinear which then divides output_size by tp_size again
    internally ... you are mixing global/local in a way that is error-prone. At minimum, add an
    explicit assertion". The pre-multiplied sizes equal the checkpoint's while ``tp_size`` divides the
    KV heads, so this layer is exact there (TP 1 and 2 on 2 KV heads). With more ranks than KV heads
    each rank keeps one replicated KV head, and ``num_kv_heads_local * tp_size`` claims ``tp_size`` KV
    heads the checkpoint does not have: the loader checks the full ``k_proj`` before it narrows, and
    the load stops with a ``WeightShapeError`` naming the tensor, the shape expected and the one found.
    """

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=True,
                 tp_rank=None, tp_size=None):
        super().__init__(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias, tp_rank, tp_size)
        num_heads_local, num_kv_heads_local = self.num_heads, self.num_kv_heads
        # The student's line: the global head counts taken as the local ones times tp_size, which the loader
        # checks the checkpoint's tensors against.
        self.total_num_heads = num_heads_local * self.tp_size
        self.total_num_kv_heads = num_kv_heads_local * self.tp_size
