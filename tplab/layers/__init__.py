"""Tensor-parallel building blocks of a Qwen2 model."""
from tplab.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tplab.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 RowParallelLinear)

__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead"]
