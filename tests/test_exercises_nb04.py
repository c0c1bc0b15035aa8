"""The notebook 04 checker accepts a right repeat_kv and names the classic mistakes."""
import pytest
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


def _expand_without_reshape(k, n):
    return k[:, :, None].expand(k.shape[0], k.shape[1], n, *k.shape[2:])


@pytest.mark.parametrize("fn, words", [
    (lambda k, n: torch.cat([k] * n, dim=1), "that is `repeat` (or torch.cat([k] * n_rep, 1))"),
    (lambda k, n: k.repeat_interleave(n, dim=0), "repeated along dim 0 (B); the KV heads are dim 1"),
    (lambda k, n: k.repeat_interleave(n), "repeat_interleave without dim flattens k"),
    (lambda k, n: k, "k came back as it is, H_kv heads"),
    (lambda k, n: k.repeat_interleave(2, 1), "each head repeated 2 times; repeat it n_rep = 3 times"),
    (_expand_without_reshape, "reshape the (B, H_kv, n_rep, T, D) expand to (B, H_kv * n_rep, T, D)"),
    (lambda k, n: k.view(k.shape[0], k.shape[1] * n, *k.shape[2:]), "they cannot make the n_rep copies: expand"),
    (lambda k, n: k.expand(k.shape[0], k.shape[1] * n, *k.shape[2:]), "expand only stretches dims of size 1")])
def test_check_repeat_kv_names_each_usual_mistake(fn, words):
    result = nb04.check_repeat_kv(fn)
    assert result.ok is False and words in result.message, result.message
