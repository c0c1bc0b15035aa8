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
