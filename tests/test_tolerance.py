"""The one bound against HF (tplab.tolerance): relative to the activation's size, with room to
spare for a correct engine and none for the student's bugs."""
import pytest
import torch

from tplab import golden
from tplab import tolerance

PROMPT = [3, 17, 42, 7, 99, 5, 23, 61, 11]


def test_the_bound_scales_with_the_activation_and_the_dtype():
    ref = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    assert tolerance.bound(ref) == pytest.approx(2.0 * 1024 * 2 ** -23)
    assert tolerance.bound(1000 * ref) == pytest.approx(1000 * tolerance.bound(ref))
    assert tolerance.bound(ref, "bfloat16") == pytest.approx(2.0 * 2 ** -7)
    assert tolerance.logprob_bound(ref) == pytest.approx(2 * tolerance.bound(ref))
    assert tolerance.bound(torch.zeros(3)) == 0.0                   # zeros must come out exactly zero
    with pytest.raises(ValueError, match="no tolerance for torch.float64"):
        tolerance.bound(ref, torch.float64)


def test_within_refuses_nan_and_other_shapes():
    ref = torch.ones(4)
    assert tolerance.within(ref + tolerance.bound(ref) / 2, ref)
    assert not tolerance.within(ref + 2 * tolerance.bound(ref), ref)
    assert not tolerance.within(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref)
    assert not tolerance.within(torch.ones(2, 2), ref)
    assert tolerance.within(torch.ones(0), torch.ones(0))


def test_golden_checks_share_one_distance_and_a_nan_or_inf_is_never_within():
    """``cmp``, ``compare`` and ``within`` answer alike: a non-finite entry is infinitely far from HF's value,
    and an empty activation is equal."""
    ref = torch.tensor([1.0, 3.0, 2.0])
    for mine in (torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([1.0, float("inf"), 2.0])):
        [row] = golden.compare({"x": ref}, {"x": mine})
        assert row.max_abs == float("inf") and row.nonfinite == 1 and not row.ok
        assert not golden.cmp("x", mine, ref) and not tolerance.within(mine, ref)
    [row] = golden.compare({"x": torch.ones(0, 4)}, {"x": torch.ones(0, 4)})
    assert row.ok and golden.cmp("x", torch.ones(0), torch.ones(0), exact=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", ["gqa", "untied"])
def test_a_correct_engine_stays_far_inside_the_bound(checkpoint, name, tp):
    """The bound is not tuned to pass: a correct run uses at most an eighth of it on every activation."""
    folder = checkpoint(name)
    rows = golden.compare(golden.hf_activations(folder, PROMPT), golden.tplab_activations(folder, PROMPT, tp))
    assert golden.worst(rows) <= 1 / 8, golden.report(rows)


@pytest.mark.parametrize("bug, tp", [("no_rope", 1), ("rope_layout", 1), ("lm_head_missing", 1), ("shard_dim1", 2),
                                     ("mask_mul_inf", 1)])
def test_every_bug_is_hundreds_of_times_over_the_bound(checkpoint, bug, tp):
    folder = checkpoint("gqa")
    rows = golden.compare(golden.hf_activations(folder, PROMPT),
                          golden.tplab_activations(folder, PROMPT, tp, bugs=[bug]))
    first = next(r for r in rows if not r.ok)
    assert first.max_abs >= 100 * first.bound, f"{bug}: {first.name} only {first.max_abs / first.bound:.0f}x the bound"
