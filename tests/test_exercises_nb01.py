"""The notebook 01 checker accepts the reference causal mask and names what is wrong with plausible mistakes."""
import torch

from tplab.exercises import nb01
from tplab.exercises.solutions import define

SOLUTION = define("causal_mask")["causal_mask"]


def test_check_causal_mask_accepts_the_solution():
    result = nb01.check_causal_mask(SOLUTION)
    assert result.ok is True and "correct" in repr(result)


def test_solution_equals_causal_visible_for_decode_and_prefix_shapes():
    for q_len, k_len in [(1, 9), (5, 9), (9, 9)]:
        assert torch.equal(SOLUTION(q_len, k_len), nb01.reference_mask(q_len, k_len))


def test_check_causal_mask_reports_a_stub_as_not_attempted():
    def stub(q_len, k_len):
        raise NotImplementedError
    result = nb01.check_causal_mask(stub)
    assert result.ok is None and "not attempted" in repr(result)


def test_check_causal_mask_rejects_tril_without_the_decode_offset():
    result = nb01.check_causal_mask(lambda q, k: torch.ones(q, k, dtype=torch.bool).tril())
    assert result.ok is False and "no offset" in result.message


def test_check_causal_mask_rejects_the_inverted_mask():
    result = nb01.check_causal_mask(lambda q, k: ~SOLUTION(q, k))
    assert result.ok is False and "inverted" in result.message


def test_check_causal_mask_rejects_the_students_float_mask():
    result = nb01.check_causal_mask(lambda q, k: torch.triu(torch.ones(q, k), 1) * float("-inf"))
    assert result.ok is False and "0 * -inf = NaN" in result.message


def test_check_causal_mask_rejects_a_hidden_diagonal():
    result = nb01.check_causal_mask(lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(k - q - 1))
    assert result.ok is False and "diagonal" in result.message


def test_check_causal_mask_reports_a_crash_as_wrong_not_as_an_exception():
    result = nb01.check_causal_mask(lambda q, k: torch.ones(q, q, dtype=torch.bool).tril()[:, :k].view(k, -1))
    assert result.ok is False and "raised RuntimeError" in result.message


def test_check_causal_mask_names_an_int64_mask_as_integer_not_float():
    def as_int64(q, k):
        return torch.ones(q, k, dtype=torch.long).tril(k - q)      # the right 1s, the wrong dtype
    result = nb01.check_causal_mask(as_int64)
    assert result.ok is False and "dtype torch.int64: return booleans" in result.message, result.message
    assert "A float mask built by multiplying" not in result.message and "`.bool()`" in result.message


def test_check_causal_mask_names_the_offset_with_its_sign_flipped():
    result = nb01.check_causal_mask(lambda q, k: torch.ones(q, k, dtype=torch.bool).tril(q - k))
    assert result.ok is False and "the offset's sign is flipped" in result.message, result.message
    assert "inverted" not in result.message                   # it sees nothing at q_len 1, not the complement


def test_check_causal_mask_names_an_additive_mask_and_not_the_nan_bug():
    def additive(q, k):
        return torch.zeros(q, k).masked_fill(~SOLUTION(q, k), float("-inf"))
    result = nb01.check_causal_mask(additive)
    assert result.ok is False and "an additive mask, 0 where visible and -inf where hidden" in result.message
    assert "`mask == 0`" in result.message and "0 * -inf" not in result.message, result.message


def test_check_causal_mask_names_hfs_additive_mask_of_finfo_min():
    result = nb01.check_causal_mask(lambda q, k: torch.where(SOLUTION(q, k), 0.0, torch.finfo(torch.float32).min))
    assert result.ok is False and "0 where visible and a large negative number (such as HF's finfo.min) where hidden" \
        in result.message, result.message
    assert "adds 1 to the visible ones" not in result.message, result.message


def test_check_causal_mask_names_a_transposed_mask():
    result = nb01.check_causal_mask(lambda q, k: SOLUTION(q, k).T)                 # (4, 4) first: the upper triangle
    assert result.ok is False and "transposed, the upper triangle" in result.message, result.message
    result = nb01.check_causal_mask(lambda q, k: torch.arange(q)[None, :] <= torch.arange(k)[:, None] - (k - q))
    assert result.ok is False and "(k_len, q_len), transposed; rows are the queries" in result.message, result.message
