"""Tensor-parallel building blocks of a Qwen2 model."""
from tplab.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tplab.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 RowParallelLinear)
from tplab.layers.weights import copy_into, materialize

__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "copy_into", "materialize"]
