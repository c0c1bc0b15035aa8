"""Load a Hugging Face safetensors checkpoint into one rank's shard of the model.

Each rank opens the files itself and reads only the rows/columns its parameters
hold (``safe_open(...).get_slice``): no rank ever materialises the full state
dict. Every checkpoint tensor must land in a parameter and every parameter must be
filled, with the shape the config implies; anything else is an error naming the
tensor and the file. An MoE checkpoint names each expert's tensors
(``mlp.experts.3.gate_proj.weight``); ``model.expert_params_mapping`` stacks them into
the experts' parameters, and under expert parallelism a rank reads only its own experts.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tplab.layers.weights import WeightShapeError, copy_into, expect_shape


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: missing, unexpected or unreadable tensors."""


class LazySlice:
    """A tensor in a safetensors file that is read only when ``materialize()`` is called,
    and then only the part ``narrow`` selected. ``reads`` collects the element count of every read."""

    def __init__(self, file_slice, name: str, index: tuple[slice, ...] | None = None, reads: list | None = None):
        self._slice, self.name = file_slice, name
        self._index = index or tuple(slice(0, n) for n in file_slice.get_shape())
        self.reads = [] if reads is None else reads      # shared with the slices narrowed from this one

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self._index)

    def __getitem__(self, index):
        raise TypeError("a lazy slice of a checkpoint tensor is not indexed: take your rows with "
                        ".narrow(dim, start, length), then copy_into(param, that) (.materialize() reads it)")

    def narrow(self, dim: int, start: int, length: int) -> "LazySlice":
        dim = dim % len(self._index)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise WeightShapeError(f"{self.name}: cannot take [{start}:{start + length}] of dim {dim} "
                                   f"from shape {self.shape}")
        index = list(self._index)
        base = index[dim].start
        index[dim] = slice(base + start, base + start + length)
        return LazySlice(self._slice, self.name, tuple(index), self.reads)

    def materialize(self) -> torch.Tensor:
        tensor = self._slice[self._index]
        self.reads.append(tensor.numel())
        return tensor


@dataclass
class LoadReport:
    """What one rank's load read: the checkpoint tensors it used, and how many elements it read
    from the files (about ``1 / tp_size`` of the checkpoint when only this rank's slices are read)."""
    names: set[str]
    elements_read: int


def checkpoint_files(model_dir) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder, or an error that says what is missing."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise FileNotFoundError(f"{model_dir} is a file: pass the checkpoint's folder, {model_dir.parent}")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint folder {model_dir} does not exist")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}: tplab reads safetensors checkpoints only "
                                "(convert with model.save_pretrained(dir, safe_serialization=True))")
    return files


def default_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Replicated parameters (RMSNorm weights): every rank takes the whole tensor."""
    expect_shape(loaded, param.shape)
    copy_into(param.data, loaded)


def checkpoint_names(model_dir) -> set[str]:
    """Every tensor name in the checkpoint's files (read from their headers only)."""
    names = set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                names.update(f.keys())
        except Exception as e:  # a truncated or corrupt file
            raise CheckpointError(f"cannot read {path}: {e}") from None
    return names


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    """The tensor names an HF checkpoint must have for ``model``: fused parameters unpacked, aliased
    parameters (``model.weight_aliases``: a pipeline's last stage's tied head) under the checkpoint's name,
    stacked experts as every expert's own tensors (all of them, also where this rank holds only some)."""
    names, alias_of = set(), {v: k for k, v in getattr(model, "weight_aliases", {}).items()}
    per_expert = {}                                   # "experts.gate_up_proj" -> its checkpoint names' tails
    for param_name, weight_name, _, _ in model.expert_params_mapping:
        per_expert.setdefault(param_name, []).append(weight_name)
    for name, _ in model.named_parameters():  # a tied lm_head shares embed_tokens and is not listed
        if name in alias_of:
            names.add(alias_of[name])
            continue
        stacked = next((p for p in per_expert if name.endswith(f".{p}")), None)
        if stacked is not None:
            names.update(name[:-len(stacked)] + w for w in per_expert[stacked])
            continue
        packed = [(src, dst) for src, (dst, _) in model.packed_modules_mapping.items() if f".{dst}." in name]
        names.update(name.replace(f".{dst}.", f".{src}.") for src, dst in packed) if packed else names.add(name)
    return names


def param_for(model: nn.Module, name: str) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id) through ``weight_aliases`` and ``packed_modules_mapping``."""
    name = getattr(model, "weight_aliases", {}).get(name, name)
    for src, (dst, shard_id) in model.packed_modules_mapping.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard_id
    return name, None


def expert_targets(model: nn.Module) -> dict[str, tuple[str, int, object]]:
    """``model.expert_params_mapping`` by checkpoint tail (``experts.3.gate_proj.weight``): the stacked
    parameter's tail, the expert and the shard id (empty for a dense model)."""
    return {w: (p, e, s) for p, w, e, s in model.expert_params_mapping}


def expert_for(targets: dict, name: str) -> tuple[str, int, object] | None:
    """An expert's checkpoint name -> (stacked parameter name, expert id, shard id); None for any other name."""
    parts = name.split(".")
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        if tail in targets:
            param, expert_id, shard_id = targets[tail]
            return name[:-len(tail)] + param, expert_id, shard_id
    return None


def destination(model: nn.Module, params: dict, experts: dict, name: str,
                path: Path) -> tuple[str, nn.Parameter, tuple]:
    """Checkpoint tensor ``name`` (in file ``path``) -> the parameter's name, the parameter, and what its
    ``weight_loader`` takes after the tensor: ``(shard_id,)``, an expert's ``(shard_id, expert_id)``. ``params``:
    ``dict(model.named_parameters())``; ``experts``: ``expert_targets(model)``."""
    expert = expert_for(experts, name) if experts else None
    param_name, shard_id = param_for(model, name) if expert is None else (expert[0], expert[2])
    if param_name not in params:
        raise CheckpointError(f"unexpected tensor {name} in {path.name}: the model built from "
                              "config.json has no such parameter (does config.json match the weights?)")
    return param_name, params[param_name], (shard_id,) if expert is None else (shard_id, expert[1])


def load_weights(model: nn.Module, model_dir, skip: frozenset[str] = frozenset()) -> LoadReport:
    """Fill ``model``'s parameters from the checkpoint in ``model_dir``, each through its ``weight_loader``.

    ``skip`` names checkpoint tensors to ignore: a tied ``lm_head.weight`` that was saved anyway, and under
    pipeline parallelism the other stages' tensors.
    """
    params, experts = dict(model.named_parameters()), expert_targets(model)
    expected, seen, reads = expected_checkpoint_names(model), set(), []
    for path in checkpoint_files(model_dir):
        try:
            handle = safe_open(path, framework="pt")
        except Exception as e:  # a truncated or corrupt file
            raise CheckpointError(f"cannot read {path}: {e}") from None
        with handle as f:
            for name in f.keys():
                if name in skip:
                    continue
                param_name, param, args = destination(model, params, experts, name, path)
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, LazySlice(f.get_slice(name), name, reads=reads), *args)
                except WeightShapeError as e:
                    why = (f"{param_name} has no weight_loader, so the whole tensor was copied in as it is: if this "
                           "rank holds a shard of it, set `param.weight_loader = self.weight_loader` in its layer's "
                           "__init__; else, " if loader is default_weight_loader else "")
                    raise WeightShapeError(f"{name} in {path.name}: {e} ({why}does config.json match the weights?)") \
                        from None
                seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s) the model needs: {shown}")
    return LoadReport(seen, sum(reads))  # about 1/tp_size of the checkpoint; compare bugs.full_load_per_rank
