"""tplab.engine.parts: the one place where bugs and a learner's parts are swapped in."""
import pytest

from tplab import LLM, Parts, SamplingParams, bugs
from tplab.engine.parts import FIELDS, known_bugs, resolve
from tplab.layers.rotary import apply_rotary
from tplab.bugs import no_rope_apply, rope_layout_apply


def my_rope(q, k, cos, sin):
    return apply_rotary(q, k, cos, sin)


def test_defaults_and_the_fields_a_learner_can_replace():
    assert resolve() == Parts() and Parts().replaced() == {}
    assert {"row_linear", "qkv_linear", "gate_up_linear", "embedding", "lm_head", "attention", "attend",
            "apply_rope", "positions", "load_weights", "block_manager"} <= set(FIELDS)


def test_bugs_and_parts_are_swapped_in_once():
    assert resolve(["no_rope"]).apply_rope is no_rope_apply
    assert resolve(parts={"apply_rope": my_rope}).apply_rope is my_rope
    both = resolve(["shard_dim1"], {"apply_rope": my_rope})          # different fields compose
    assert set(both.replaced()) == {"qkv_linear", "gate_up_linear", "apply_rope"}
    assert resolve(["no_rope"], both.__class__(apply_rope=no_rope_apply)) == resolve(["no_rope"])  # resolved twice


def test_two_replacements_of_one_field_name_both():
    with pytest.raises(ValueError, match="bug 'no_rope' and bug 'rope_layout' both replace Parts.apply_rope"):
        resolve(["no_rope", "rope_layout"])
    with pytest.raises(ValueError, match="bug 'rope_layout' and your part my_rope both replace Parts.apply_rope"):
        resolve(["rope_layout"], {"apply_rope": my_rope})
    assert resolve(["rope_layout"]).apply_rope is rope_layout_apply


def test_unknown_names_say_what_exists():
    with pytest.raises(ValueError, match=r"unknown bug name\(s\) \['nope'\]; known: \['mask_mul_inf'"):
        resolve(["nope"])
    with pytest.raises(ValueError, match=r"parts has unknown field\(s\) \['rowlinear'\]; the fields of tplab.Parts"):
        resolve(parts={"rowlinear": object})
    assert set(bugs.NAMES) == set(known_bugs())


def test_llm_takes_parts_and_bugs_by_name(checkpoint):
    calls = []

    def counted_rope(q, k, cos, sin):
        calls.append(q.shape[0])
        return apply_rotary(q, k, cos, sin)
    with LLM(checkpoint("gqa"), parts={"apply_rope": counted_rope}) as llm:     # TP 1: runs in this process
        assert llm.config.parts.apply_rope is counted_rope
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert calls and calls[0] == 3, "the engine did not run the part it was given"
    with pytest.raises(ValueError, match="both replace Parts.apply_rope"):
        LLM(checkpoint("gqa"), bugs=["no_rope"], parts={"apply_rope": my_rope})


def test_a_class_part_given_as_an_instance_or_a_function_is_refused_before_anything_is_built():
    from tplab.layers.linear import RowParallelLinear
    with pytest.raises(ValueError, match=r"parts\['row_linear'\]: pass the class itself \(as tplab's RowParallelLinear\), "
                                         r"not an instance of RowParallelLinear"):
        resolve(parts={"row_linear": RowParallelLinear(8, 8, tp_rank=0, tp_size=1)})
    with pytest.raises(ValueError, match=r"parts\['block_manager'\]: .* not the function my_rope"):
        resolve(parts={"block_manager": my_rope})
    assert resolve(parts={"apply_rope": my_rope}).apply_rope is my_rope     # a function where the engine calls one


@pytest.mark.parametrize("settings, bug, needs", [
    ({}, "sp_scatter_hidden", "sequence_parallel=True at tensor_parallel_size > 1"),
    ({"sequence_parallel": True}, "sp_norm_twice", "sequence_parallel=True at tensor_parallel_size > 1"),
    ({}, "graph_stale_inputs", r"decode steps at fixed shapes \(static_decode=True"),
    ({}, "moe_global_ids", "a mixture-of-experts checkpoint"),
    ({}, "pp_residual_not_sent", r"pipeline_parallel_size > 1 \(one stage holds every layer"),
    ({"tensor_parallel_size": 2}, "pp_kv_every_layer", r"pipeline_parallel_size > 1"),
])
def test_a_bug_this_engine_never_uses_is_refused_not_shown_harmless(checkpoint, settings, bug, needs):
    """Without its setting the bug's part is never built, and HF's tokens would call the pitfall harmless."""
    from tplab.engine.config import engine_config
    with pytest.raises(ValueError, match=rf"bug '{bug}' replaces Parts\.\w+, which this engine never uses: it runs "
                                         rf"only with {needs}.*Add that, or drop the bug"):
        engine_config(checkpoint("gqa"), bugs=[bug], **settings)


def test_a_part_this_engine_never_uses_is_refused_and_used_where_its_setting_is_on(checkpoint):
    from tplab.engine.config import engine_config
    from tplab.engine.static_decode import StaticDecode

    class MyStatic(StaticDecode):
        pass
    with pytest.raises(ValueError, match=r"your part .*MyStatic replaces Parts.static_decode, which this engine never "
                                         r"uses: .* Add that, or drop the part"):
        engine_config(checkpoint("gqa"), parts={"static_decode": MyStatic})
    assert engine_config(checkpoint("gqa"), parts={"static_decode": MyStatic}, static_decode=True).parts.static_decode \
        is MyStatic
    assert engine_config(checkpoint("gqa"), bugs=["graph_stale_inputs"], static_decode=True).static_decode


def test_an_instructors_own_pitfall_is_found_by_name_beside_tplabs(monkeypatch):
    """``provide_bugs`` is how ``tplab/__init__.py`` hands the engine tplab.bugs; another catalogue joins the names."""
    import tplab.engine.parts as parts_module
    monkeypatch.setattr(parts_module, "_bug_catalogues", list(parts_module._bug_catalogues))
    parts_module.provide_bugs(lambda: {"rope_mine": {"apply_rope": my_rope}})
    assert resolve(["rope_mine"]).apply_rope is my_rope
    assert resolve(["no_rope"]).apply_rope is no_rope_apply                       # tplab's are still there
    assert "rope_mine" in known_bugs() and set(bugs.NAMES) < set(known_bugs())
