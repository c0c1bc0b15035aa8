"""Loading: each rank reads only its slices; bad checkpoints fail naming the tensor and file."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tplab.engine.config import EngineConfig
from tplab.engine.probe import load_model
from tplab.models.loader import CheckpointError, LazySlice
from tplab.layers.weights import WeightShapeError


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_reads_only_its_shard(checkpoint, monkeypatch, tp):
    """Count the elements read from the files per rank: a rank's share, not the whole checkpoint.

    (On a config without KV-head replication, so the share is exactly 1/tp plus replicated norms.)
    """
    folder = checkpoint("vocab_pad")
    full = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    real, read = LazySlice.materialize, []

    def counting(self):
        tensor = real(self)
        read.append(tensor.numel())
        return tensor
    monkeypatch.setattr(LazySlice, "materialize", counting)
    for rank in range(tp):
        read.clear()
        model = load_model(folder, tp, tp_rank=rank)
        held = sum(p.numel() for p in model.parameters())
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)   # replicated on every rank
        # what it holds, read; less at most the vocab's padding row (64), which no file holds
        assert held - 64 <= sum(read) <= held, f"rank {rank} read {sum(read)} elements and holds {held}"
        share = (full - norms) / tp + norms + 64                   # + at most one padding row of the vocab
        assert held <= share, f"rank {rank} holds {held} parameters, more than its share {share:.0f}"


def test_missing_lm_head_is_an_error_naming_it(checkpoint, tmp_path):
    folder = _copy(checkpoint("untied"), tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing 1 tensor.*lm_head.weight"):
        load_model(folder)


def test_unexpected_tensor_is_an_error_naming_it(checkpoint, tmp_path):
    folder = _copy(checkpoint("gqa"), tmp_path / "ckpt", lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor model.extra.weight in model.safetensors"):
        load_model(folder)


def test_misshaped_tensor_names_tensor_and_both_shapes(checkpoint, tmp_path):
    def transpose(t):
        name = "model.layers.1.mlp.down_proj.weight"
        t[name] = t[name].T.contiguous()
    folder = _copy(checkpoint("gqa"), tmp_path / "ckpt", transpose)
    with pytest.raises(WeightShapeError, match=r"model.layers.1.mlp.down_proj.weight in model.safetensors.*"
                                               r"expected shape \(64, 128\), found \(128, 64\)"):
        load_model(folder, 2, tp_rank=1)


class RowWithoutLoader(torch.nn.Module):
    """A row-parallel part whose sharded weight has no ``weight_loader`` (the default copies the whole tensor)."""

    def __init__(self, input_size, output_size, bias=False, tp_rank=None, tp_size=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size // tp_size), requires_grad=False)


def test_a_sharded_parameter_without_a_weight_loader_is_named_with_the_fix(checkpoint):
    with pytest.raises(WeightShapeError, match=r"down_proj.weight in model.safetensors: expected shape \(64, 64\), "
                                               r"found \(64, 128\) \(model.layers.0.mlp.down_proj.weight has no "
                                               r"weight_loader.*param.weight_loader = self.weight_loader"):
        load_model(checkpoint("gqa"), 2, tp_rank=1, parts={"row_linear": RowWithoutLoader})


def test_config_that_disagrees_with_weights_is_an_error(checkpoint, tmp_path):
    folder = _copy(checkpoint("gqa"), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightShapeError, match=r"model.layers.0.mlp.\w+_proj.weight in model.safetensors: "
                                               r"expected shape \((96, 64|64, 96)\), found \((128, 64|64, 128)\)"):
        load_model(folder)


def test_truncated_file_is_an_error_naming_the_file(checkpoint, tmp_path):
    folder = _copy(checkpoint("gqa"), tmp_path / "ckpt")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        load_model(folder)


def test_folder_errors_say_what_is_wrong(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineConfig(model=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        EngineConfig(model=str(tmp_path / "empty"))
    folder = _copy(checkpoint("gqa"), tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'; tplab runs Qwen2"):
        EngineConfig(model=str(folder))
    (folder / "config.json").write_text(json.dumps(config)[:-1])       # the closing brace lost in an edit
    with pytest.raises(ValueError, match="config.json is not valid JSON .*: fix the file"):
        EngineConfig(model=str(folder))


def test_rope_scaling_is_refused_not_ignored(checkpoint, tmp_path):
    folder = _copy(checkpoint("gqa"), tmp_path / "yarn")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope_type='yarn' is not implemented"):
        EngineConfig(model=str(folder))


def test_the_config_is_resolved_once_frozen_and_reaches_ranks_as_is(checkpoint, monkeypatch):
    """Settings resolve once (the environment read then, as defaults), the value is frozen, and a pickled
    copy (what a rank receives) equals it; an unknown setting names the ones there are."""
    import pickle
    from dataclasses import FrozenInstanceError

    from tplab import LLM
    from tplab.layers.linear import LinearBase

    monkeypatch.setenv("TPLAB_ONEDNN", "0")
    cfg = EngineConfig(model=checkpoint("gqa"), dtype="bf16")
    monkeypatch.setenv("TPLAB_ONEDNN", "1")                      # read once: too late for cfg
    assert cfg.onednn is False and cfg.dtype is torch.bfloat16 and cfg.device == "cpu"
    assert EngineConfig(model=checkpoint("gqa")).onednn is True
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(FrozenInstanceError):
        cfg.seed = 1
    layers = [m for m in load_model(cfg).modules() if isinstance(m, LinearBase)]
    gemms = [m.linear_method.gemm for m in layers]
    assert gemms and all(not g.onednn and not g.pack for g in gemms)               # F.linear, as asked
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['tensor_parallel'\]; the settings are"):
        LLM(checkpoint("gqa"), tensor_parallel=2)
    for device in ("gpu", "CPU", "mps", 0):                # torch's own errors named none of what tplab runs on
        with pytest.raises(ValueError, match=rf"device={device!r}: tplab runs on 'cpu' or 'cuda'"):
            EngineConfig(model=checkpoint("gqa"), device=device)
    assert EngineConfig(model=checkpoint("gqa"), device=torch.device("cpu")).device == "cpu"


def test_a_lazy_slice_indexed_like_a_tensor_says_how_to_take_rows(checkpoint):
    """A weight_loader that writes ``loaded[a:b]`` (as on a tensor) is told to narrow instead; so is one run by
    ``check_part``, whose probe hands over a ``TensorSlice`` of the same kind."""
    from safetensors import safe_open

    from tplab.exercises.layer_probes import TensorSlice
    with safe_open(str(checkpoint("gqa") / "model.safetensors"), framework="pt") as f:
        name = next(iter(f.keys()))
        lazy = LazySlice(f.get_slice(name), name)
        for sliced in (lazy, TensorSlice(torch.zeros(4, 2))):
            with pytest.raises(TypeError, match=r"not indexed: take your rows with \.narrow\(dim, start, length\)"):
                sliced[0:2]
