"""Helpers every ``weight_loader`` shares: shape checks and copying a (lazy) shard in."""
import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one the model expects."""


def expect_shape(loaded, expected: tuple[int, ...], what: str = "") -> None:
    """Raise ``WeightShapeError`` naming both shapes when ``loaded`` has the wrong *full* shape.

    Loaders check the whole tensor before narrowing it: a transposed weight can
    survive a narrow on the wrong dimension and load silently wrong.
    """
    found = tuple(loaded.shape)
    if found != tuple(expected):
        raise WeightShapeError(f"{what + ': ' if what else ''}expected shape {tuple(expected)}, found {found}")


def materialize(loaded) -> torch.Tensor:
    """A real tensor from either a tensor or a lazy safetensors slice (see ``tplab.models.loader``)."""
    return loaded.materialize() if hasattr(loaded, "materialize") else loaded


def copy_into(dst: torch.Tensor, loaded) -> None:
    """Read ``loaded`` (only this slice, if it is lazy) and copy it into ``dst``, casting the dtype."""
    expect_shape(loaded, dst.shape, "shard")
    with torch.no_grad():
        dst.copy_(materialize(loaded))
