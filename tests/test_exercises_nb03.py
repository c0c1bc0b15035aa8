"""The notebook 03 checker accepts RoPE in tplab's layout and catches layouts that broadcast silently wrong."""
import pytest
import torch

from tplab.exercises import nb03
from tplab.exercises.solutions import define

SOLUTION = define("apply_rope")["apply_rope"]
from tplab.layers.rotary import apply_rotary


def test_check_apply_rope_accepts_the_solution():
    result = nb03.check_apply_rope(SOLUTION)
    assert result.ok is True and "correct" in repr(result)


def test_check_apply_rope_accepts_tplabs_apply_rotary():
    result = nb03.check_apply_rope(lambda x, cos, sin: apply_rotary(x, x, cos, sin)[0])
    assert result.ok is True


def test_hf_reference_is_hf_apply_rotary_pos_emb_in_hfs_layout():
    x = torch.randn(6, 2, 8)
    cos, sin = nb03.rope_table(torch.arange(6), 8)
    assert torch.allclose(nb03.hf_reference(x, cos, sin), SOLUTION(x, cos, sin), atol=1e-6)


def test_check_apply_rope_reports_a_stub_as_not_attempted():
    def stub(x, cos, sin):
        raise NotImplementedError
    result = nb03.check_apply_rope(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_check_apply_rope_reports_the_missing_head_axis_as_silent_where_it_broadcasts():
    def no_head_axis(x, cos, sin):                  # (T, H, D) * (T, D): runs when T == H, or T == 1
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    result = nb03.check_apply_rope(no_head_axis)
    assert result.ok is False
    assert "T=4, H=4, D=8: ran without an error but the numbers are wrong (silent)" in result.message
    assert "heads axis" in result.message and "errors for some shapes and silently" in result.message


def test_check_apply_rope_names_the_interleaved_layout():
    def interleaved(x, cos, sin):
        pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos[:, None] + pairs * sin[:, None]
    result = nb03.check_apply_rope(interleaved)
    assert result.ok is False and "rope_layout" in result.message and "silent" in result.message


def test_check_apply_rope_names_no_rotation():
    result = nb03.check_apply_rope(lambda x, cos, sin: x)
    assert result.ok is False and "no_rope" in result.message


def test_check_apply_rope_names_a_float64_result():
    result = nb03.check_apply_rope(lambda x, cos, sin: apply_rotary(x, x, cos, sin)[0].double())
    assert result.ok is False and "returned torch.float64, but x, cos and sin are torch.float32" in result.message, \
        result.message


def test_check_apply_rope_asks_for_a_tensor_when_given_a_list():
    result = nb03.check_apply_rope(lambda x, cos, sin: apply_rotary(x, x, cos, sin)[0].tolist())
    assert result.ok is False and "returned list, expected a torch.Tensor (T, H, D)" in result.message, result.message
    assert "broadcast" not in result.message                  # a list is not a layout mistake


def _rope(x, cos, sin, rotate=lambda x1, x2: torch.cat((-x2, x1), -1), c=None, s=None):
    """The right rotation, with one piece swappable: rotate_half, or the tables each term is multiplied by."""
    c, s = (cos if c is None else c)[:, None], (sin if s is None else s)[:, None]
    return x * c + rotate(*x.chunk(2, dim=-1)) * s


@pytest.mark.parametrize("fn, words", [
    (lambda x, cos, sin: _rope(x, cos, sin, rotate=lambda x1, x2: torch.cat((-x1, x2), -1)), "negates the wrong half"),
    (lambda x, cos, sin: _rope(x, cos, sin, rotate=lambda x1, x2: torch.cat((x2, x1), -1)), "without the minus"),
    (lambda x, cos, sin: _rope(x, cos, sin, s=cos), "multiplies both terms by cos"),
    (lambda x, cos, sin: _rope(x, cos, sin, c=sin, s=cos), "cos and sin swapped"),
    (lambda x, cos, sin: x * cos[:, None] + torch.cat((-x.chunk(2, 1)[1], x.chunk(2, 1)[0]), 1) * sin[:, None],
     "split x along dim 1, the heads"),
    (lambda x, cos, sin: _rope(x, cos, sin, rotate=lambda x1, x2: torch.cat((x1 * 0, x2), -1)),
     "it is x * cos + rotate_half(x) * sin"),                           # none of the usual: the formula, in words
])
def test_check_apply_rope_names_wrong_rotations(fn, words):
    result = nb03.check_apply_rope(fn)
    assert result.ok is False and words in result.message, result.message


def test_check_apply_rope_names_a_result_left_in_hfs_heads_first_layout():
    def heads_first(x, cos, sin):
        xh = x.transpose(0, 1)                                           # (H, T, D), rotated right, not put back
        return xh * cos + torch.cat((-xh.chunk(2, -1)[1], xh.chunk(2, -1)[0]), -1) * sin
    result = nb03.check_apply_rope(heads_first)
    assert result.ok is False and "T=5, H=3, D=8: returned (3, 5, 8): (H, T, D), HF's layout" in result.message
    assert "T=4, H=4, D=8: ran without an error but the numbers are wrong (silent): (H, T, D)" in result.message
    assert "cos/sin broadcast to the wrong shape" not in result.message, result.message
    assert "errors for some shapes" not in result.message, result.message          # no shape raised
