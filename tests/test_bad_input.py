"""Bad input gets a clear error that says what to change, before any rank starts: not a deep traceback, a silent
wrong answer, or a verdict that blames the learner's part for tplab's own refusal. Where a check must run before
the ranks, the ranks are replaced by a stub that fails the test if it is reached."""
import json
import time

import pytest
import torch

import tplab.exercises.parts as parts_module
import tplab.distributed.launcher as launcher
from tplab import golden, launch, models
from tplab.distributed.launcher import RankGroup
from tplab.exercises import check_engine, check_part
from tplab.layers.linear import RowParallelLinear
from tplab.models.registry import load_model_config

M = models.tiny_stories()                    # the shipped tiny model: 4 query heads, 2 KV heads, vocab 2048
IN_VOCAB = r"non-empty list of ints in \[0, 2048\)"


def _not_reached(*args, **kwargs):
    raise AssertionError("reached the ranks (or the model build) with input that could be refused before them")


# --- TP sizes the shipped model cannot split: refused as such, not as a mistake in the learner's part


def test_check_part_refuses_a_tp_size_of_the_shipped_model_before_judging(monkeypatch):
    monkeypatch.setattr(parts_module, "_judge_part", _not_reached)
    with pytest.raises(ValueError, match=r"shipped model.*tensor_parallel_size=3 .*TP sizes that work: \[1, 2, 4\]"):
        check_part("row_linear", RowParallelLinear, tensor_parallel_size=3)      # tplab's own, correct class


def test_check_engine_refuses_a_tp_size_of_the_shipped_model_before_judging(monkeypatch):
    monkeypatch.setattr(parts_module, "judge_in_engine", _not_reached)
    with pytest.raises(ValueError, match=r"TP sizes that work: \[1, 2, 4\]"):
        check_engine({"row_linear": RowParallelLinear}, tensor_parallel_size=8)


def test_tplab_activations_refuses_a_tp_size_before_launching(monkeypatch):
    monkeypatch.setattr(golden, "launch", _not_reached)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not work.*TP sizes that work: \[1, 2, 4\]"):
        golden.tplab_activations(M, [1, 2, 3], tensor_parallel_size=3)


# --- token ids: a string, an empty or nested list, an id past the vocabulary


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32).eval()


BAD_IDS = {"empty": [], "past_vocab": [1, 99999], "negative": [1, -2], "string": "Once upon",
           "2d_tensor": torch.tensor([[1, 2, 3]]), "floats": [1.0, 2.0]}


@pytest.mark.parametrize("ids", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_hf_activations_refuses_bad_ids_with_what_to_pass(hf, ids):
    with pytest.raises(ValueError, match=IN_VOCAB + r".*tokenize a string first \(llm.tokenizer.encode\)"):
        golden.hf_activations(hf, ids)


@pytest.mark.parametrize("ids", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_tplab_activations_refuses_bad_ids_before_building(ids, monkeypatch):
    monkeypatch.setattr(golden, "rank_activations", _not_reached)
    with pytest.raises(ValueError, match=IN_VOCAB):
        golden.tplab_activations(M, ids)


def test_a_1d_tensor_of_ids_still_works_as_its_list(hf):
    ids = [3, 17, 42, 99]
    as_list, as_tensor = golden.hf_activations(hf, ids), golden.hf_activations(hf, torch.tensor(ids))
    assert torch.equal(as_list["logits"], as_tensor["logits"])
    assert torch.equal(golden.tplab_activations(M, torch.tensor(ids))["logits"],
                       golden.tplab_activations(M, ids)["logits"])


# --- random checkpoints: attention no model can build, misspelt fields


@pytest.mark.parametrize("shape, words", [
    (dict(num_attention_heads=4, num_key_value_heads=3), r"num_key_value_heads=3.*one of \[1, 2, 4\]"),
    (dict(hidden_size=60, num_attention_heads=8), r"hidden_size=60 .*multiple of 16 \(48 or 64\)"),
    (dict(hidden_size=60, num_attention_heads=4, num_key_value_heads=2), r"hidden_size=60 .*even head_dim"),
], ids=["kv_heads_3", "hidden_60_heads_8", "odd_head_dim"])
def test_save_random_refuses_an_attention_no_model_can_build(tmp_path, shape, words):
    with pytest.raises(ValueError, match=words):
        models.save_random_qwen2(tmp_path / "bad", **shape)
    assert not (tmp_path / "bad").exists()                  # refused before anything is written


def test_loading_a_checkpoint_whose_heads_do_not_group_names_the_file_and_field(tmp_path):
    folder = models.save_random_qwen2(tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match=r"config.json: num_attention_heads=4 .*num_key_value_heads=3"):
        load_model_config(folder)


def test_explicit_head_dims_still_load(tmp_path):
    """Qwen3's head_dim is explicit and need not be hidden / heads (32 vs 16); a Qwen2 may set one too."""
    folders = [models.save_random_qwen3(tmp_path / "qwen3"), models.save_random_qwen3_moe(tmp_path / "qwen3_moe"),
               models.save_random_qwen2(tmp_path / "qwen2", hidden_size=48, num_attention_heads=6, head_dim=16,
                                        num_key_value_heads=2, rope_theta=1e6), models.tiny_moe(), M]
    assert [load_model_config(f).model_type for f in folders] == ["qwen3", "qwen3_moe", "qwen2", "qwen3_moe", "qwen2"]


@pytest.mark.parametrize("save, key, near", [
    (models.save_random_qwen2, "num_layers", "num_hidden_layers"),
    (models.save_random_qwen2, "num_kv_heads", "num_key_value_heads"),
    (models.save_random_qwen3_moe, "num_expert", "num_experts"),
])
def test_save_random_refuses_a_misspelt_field_naming_the_nearest(tmp_path, save, key, near):
    with pytest.raises(ValueError, match=rf"unknown Qwen\w+Config field '{key}': did you mean '{near}'\?"):
        save(tmp_path / "typo", **{key: 6})
    assert not (tmp_path / "typo").exists()


# --- launch: arguments that are no tuple; a timeout that may only have been too short


@pytest.mark.parametrize("args, words", [(10.0, r"got float 10.0 \(one argument: args=\(10.0,\)\)"),
                                         ("ab", r"got str 'ab' \(one argument: args=\('ab',\)\)")])
def test_launch_refuses_args_that_are_no_tuple_before_any_rank_starts(monkeypatch, args, words):
    monkeypatch.setattr(launcher, "RankGroup", _not_reached)
    with pytest.raises(ValueError, match=r"args must be a tuple of fn's arguments, " + words):
        launch(print, world_size=2, args=args)


def test_launch_refuses_a_function_that_is_no_callable_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(launcher, "RankGroup", _not_reached)
    with pytest.raises(ValueError, match=r"fn must be a function \(or another callable\) to run in every rank, "
                                         r"got int 42"):
        launch(42, world_size=2)


def test_a_timeout_says_a_long_call_needs_a_larger_timeout():
    with RankGroup(1, timeout=60) as group:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer within 1 s.*still working.*larger timeout="):
            group.run(time.sleep, (60,), timeout=1)
        assert time.monotonic() - start < 1 + 5


def test_the_tp_sizes_listed_when_the_heads_refuse_one_split_the_mlp_too(tmp_path):
    """12 heads and an intermediate size of 128: TP 6 splits the heads but not the MLP, so a refusal of TP 5 on
    the heads must not offer 6 (it once listed [1, 2, 4, 6, 12])."""
    from tplab.models.registry import check_tp_size
    config = load_model_config(models.save_random_qwen2(tmp_path / "m", hidden_size=96, num_attention_heads=12,
                                                        num_key_value_heads=2, intermediate_size=128))
    for tp in (5, 6):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp} does not work: .*TP sizes that work: "
                                             r"\[1, 2, 4\]$"):
            check_tp_size(config, tp)
