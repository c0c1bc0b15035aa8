"""What every checker shares: not attempted for the stub, the forgotten `return` named, solutions listed."""
import pytest

from tplab.exercises import FORGOT_RETURN, nb01, nb02, nb03, nb04, nb05, nb06, show_solution
from tplab.exercises import solutions

CHECKERS = {"causal_mask": nb01.check_causal_mask, "shard": nb02.check_shard, "apply_rope": nb03.check_apply_rope,
            "repeat_kv": nb04.check_repeat_kv, "slot_mapping": nb05.check_slot_mapping,
            "vocab_shard_range": nb06.check_vocab_shard_range}


@pytest.mark.parametrize("name", CHECKERS)
def test_a_function_that_returns_nothing_is_told_it_forgot_return(name):
    def forgot(*args):
        args[0]                                         # computes something, returns nothing
    result = CHECKERS[name](forgot)
    assert result.ok is False and result.message == FORGOT_RETURN


@pytest.mark.parametrize("name", CHECKERS)
def test_every_reference_solution_passes_its_checker(name):
    assert CHECKERS[name](solutions.define(name)[name]).ok is True


def test_show_solution_prints_the_cell_and_names_the_exercises(capsys):
    show_solution("causal_mask")
    assert capsys.readouterr().out.startswith("# Exercise: causal_mask (reference solution)")
    with pytest.raises(KeyError, match="no exercise named 'nope'; the exercises are \\['apply_rope'"):
        show_solution("nope")
