# Exercise: shard (reference solution)
import torch


def shard(weight: torch.Tensor, rank: int, tp: int, kind: str) -> torch.Tensor:
    """Column parallel splits dim 0 (out_features), row parallel splits dim 1 (in_features)."""
    dim = {"column": 0, "row": 1}[kind]
    size = weight.shape[dim] // tp                       # rows (column) or columns (row) per rank
    return weight.narrow(dim, rank * size, size)         # (out / tp, in) or (out, in / tp)
