"""The notebook 04 checker accepts a right repeat_kv and names the classic mistakes."""
import torch

from tplab.exercises import nb04
from tplab.exercises.solutions import define

SOLUTION = define("repeat_kv")["repeat_kv"]


def test_check_repeat_kv_accepts_the_solution():
    result = nb04.check_repeat_kv(SOLUTION)
    assert result.ok is True and "correct" in repr(result)


def test_check_repeat_kv_accepts_repeat_interleave():
    result = nb04.check_repeat_kv(lambda k, n: k.repeat_interleave(n, dim=1))
    assert result.ok is True


def test_solution_equals_hf_repeat_kv():
    k = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(SOLUTION(k, 2), nb04.hf_repeat_kv(k, 2))


def test_check_repeat_kv_reports_a_stub_as_not_attempted():
    def stub(k, n_rep):
        raise NotImplementedError
    result = nb04.check_repeat_kv(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_check_repeat_kv_rejects_repeat_instead_of_repeat_interleave():
    result = nb04.check_repeat_kv(lambda k, n: k.repeat(1, n, 1, 1))
    assert result.ok is False and "that is `repeat`" in result.message and "[0, 0, 1, 1]" in result.message


def test_check_repeat_kv_rejects_repeating_the_wrong_dimension():
    result = nb04.check_repeat_kv(lambda k, n: k.repeat_interleave(n, dim=2))
    assert result.ok is False and "shape" in result.message


def test_check_repeat_kv_names_a_float64_result():
    result = nb04.check_repeat_kv(lambda k, n: k.double().repeat_interleave(n, 1))
    assert result.ok is False and "returned torch.float64, but k is torch.float32" in result.message, result.message


def test_check_repeat_kv_names_tokens_mixed_into_heads_without_contradicting_itself():
    def mixed(k, n):                                          # right head order, but tokens spread over heads
        return k.repeat_interleave(n, dim=2).reshape(k.shape[0], -1, k.shape[2], k.shape[3])
    result = nb04.check_repeat_kv(mixed)
    assert result.ok is False and "expected [0, 0, 1, 1]" not in result.message, result.message
    assert "at [b, h, t, d] = [0, 0, 1, 0]" in result.message and "which is k[0, 0, 0, 0]" in result.message
    assert "values moved to another token" in result.message


def test_check_repeat_kv_names_changed_values():
    result = nb04.check_repeat_kv(lambda k, n: k.repeat_interleave(n, dim=1) * 1.5)
    assert result.ok is False and "a value k does not hold" in result.message, result.message
    assert "KV head h // n_rep = 0" in result.message
