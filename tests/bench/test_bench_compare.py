"""``inductor_ext.bench.compare`` on CPU: the comparison counts what it says, the one-ulp nudge
moves what it says, and the sensitivity criterion accepts a difference within twice the eager
layer's own and rejects three times it."""

import pytest
import torch

from inductor_ext.bench import compare as cmp
from lowerings._rounding import ulp_distance


def test_compare_counts_elements_tokens_and_close():
    expected = torch.ones(4, 2, 8)
    actual = expected.clone()
    actual[1, 0, 3] += 0.5  # one element of token 1 beyond atol 2e-2 + rtol 2e-2
    actual[2] += 1e-3  # within the bound
    stats = cmp.compare(actual.bfloat16(), expected)
    assert stats["mismatched"] == 1 and stats["tokens_mismatched"] == 1 and stats["elements"] == 64
    assert not stats["close"] and stats["max_abs"] == pytest.approx(0.5)
    assert stats["max_rel"] == pytest.approx(0.5) and stats["rel_l2"] == pytest.approx(0.5 / 8, rel=1e-2)
    assert cmp.compare(expected, expected)["close"]
    assert not cmp._within(stats, "kda")  # KDA: 1e-4 of the elements, rel L2 1e-2
    assert cmp._within(stats, "dsa")  # DSA: 1/64 of the elements and rel L2 0.0625 (≤ 5 %, ≤ 0.1)
    assert cmp._within(cmp.compare(expected, expected), "kda")


def test_nudge_ulp_moves_elements_by_at_most_one_ulp():
    x = torch.randn(64, 256).bfloat16()
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    y = cmp.nudge_ulp(x)
    dist = ulp_distance(y, x)
    assert int(dist.max()) == 1 and torch.equal(y[0, :4].view(torch.int16), x[0, :4].view(torch.int16))
    assert 0.6 < dist.float().mean().item() < 0.73  # two thirds moved
    assert torch.equal(cmp.nudge_ulp(x), y)  # seeded
    with pytest.raises(ValueError, match="bfloat16"):
        cmp.nudge_ulp(x.float())


def test_sensitivity_criterion():
    """Beyond the fixed bound, a difference within 2x the eager layer's own one-ulp sensitivity
    still equals eager; 3x it does not."""
    e = torch.randn(256, 64)
    sens = cmp.compare(e + 0.1 * torch.randn(256, 64), e)
    near = cmp.compare(e + 0.15 * torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), e)
    far = cmp.compare(e + 0.3 * torch.randn(256, 64, generator=torch.Generator().manual_seed(2)), e)
    assert not cmp._within(near, "dsa") and not cmp._within(far, "dsa")
    assert cmp._within_sensitivity(near, sens) and not cmp._within_sensitivity(far, sens)
    assert not cmp._within_sensitivity(near, None)
    row = {"eager_sensitivity": sens}
    out = e + 0.15 * torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    cmp.check_row(row, {"first": {"out": out, "ids": None}, "res_x": {"out": out, "ids": None},
                        "res_check": (out, None)}, {"out": e, "ids": None}, "fwd", "dsa", [])
    assert row["equals_eager"] is True and row["equals_eager_by"] == "sensitivity"
    cmp.check_row(row, {"first": {"out": out, "ids": None}, "res_x": {"out": out, "ids": None},
                        "res_check": (e + 0.3 * torch.randn(256, 64), None)}, {"out": e, "ids": None}, "fwd", "dsa", [])
    assert row["equals_eager"] is False and row["equals_eager_by"] is None
