"""Aggregation rules: centered clipping and trimming are the mean for honest members and bound a rogue one's
pull; trimming leaves a far one out."""

import pytest
import torch

from swarm.sync.robust_mean import aggregation_rule, centered_clip, centered_trim


def _honest(n: int, d: int = 1000, spread: float = 0.01, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    return base + spread * torch.randn(n, d, generator=g)


@pytest.mark.parametrize("rule", [centered_clip, centered_trim])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_honest_members_get_the_exact_mean(n, rule):
    parts = _honest(n)
    assert torch.allclose(rule(parts), parts.mean(0), atol=1e-6)


def test_shape_is_kept():
    parts = _honest(3, d=24).view(3, 4, 6)
    assert centered_clip(parts).shape == centered_trim(parts).shape == (4, 6)


@pytest.mark.parametrize("attack", ["negated", "scaled", "huge", "far"])
def test_one_rogue_of_three_moves_the_result_at_most_tau_from_the_honest_range(attack):
    g = torch.Generator().manual_seed(1)
    reference, step = torch.randn(1000, generator=g), 0.01 * torch.randn(1000, generator=g)
    updates = step + 0.002 * torch.randn(2, 1000, generator=g)  # two honest members' changes: alike
    honest = reference + updates
    rogue = {
        "negated": reference - updates[0],
        "scaled": reference + 3 * updates[0] / updates[0].norm() * updates.norm(dim=1).max(),
        "huge": torch.full((1000,), 1e38),
        "far": reference + 50.0,
    }[attack]
    got = centered_clip(torch.stack([honest[0], rogue, honest[1]]), clip_factor=2.0)
    # the centre lies between the honest values, coordinate by coordinate
    lo, hi = honest.min(0).values, honest.max(0).values
    center = torch.stack([honest[0], rogue, honest[1]]).sort(0).values[1]
    assert bool(((center >= lo - 1e-6) & (center <= hi + 1e-6)).all())
    # tau is at most twice an honest member's distance from the centre
    tau = 2 * max((h - center).norm() for h in honest)
    assert (got - center).norm() <= tau + 1e-4
    # so the rogue pulled the result no farther from the honest mean than the honest spread allows
    honest_spread = (honest[0] - honest[1]).norm()
    assert (got - honest.mean(0)).norm() <= 3 * honest_spread
    assert (rogue - honest.mean(0)).norm() > 3 * honest_spread  # and the attack was well outside it
    # the rogue's pull on the mean itself would have been larger than what the rule let through
    plain = torch.stack([honest[0], rogue, honest[1]]).double().mean(0).float()
    assert (got - honest.mean(0)).norm() < (plain - honest.mean(0)).norm()


def test_non_finite_members_are_left_out():
    honest = _honest(2)
    for bad in (float("nan"), float("inf"), float("-inf")):
        rogue = honest[0].clone()
        rogue[7] = bad
        got = centered_clip(torch.stack([honest[0], rogue, honest[1]]))
        assert torch.allclose(got, honest.mean(0), atol=1e-6)
    assert torch.isnan(centered_clip(torch.full((2, 5), float("nan")))).all()


def test_two_identical_members_outvote_a_third():
    same = _honest(1)[0]
    other = same + 1.0
    got = centered_clip(torch.stack([same, same, other]))
    assert torch.equal(got, same)


def test_rules_by_name():
    assert aggregation_rule("mean") is None
    parts = _honest(3)
    assert torch.allclose(aggregation_rule("centered_clip", 3.0)(parts), parts.mean(0), atol=1e-6)
    assert torch.allclose(aggregation_rule("centered_trim", 3.0)(parts), parts.mean(0), atol=1e-6)
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        aggregation_rule("median")


@pytest.mark.parametrize("attack", ["negated", "scaled", "huge", "far", "nan"])
def test_trimming_leaves_a_far_rogue_out_entirely(attack):
    """What clipping lets through each round (tau / 3, the same way every round for these attacks),
    trimming does not: the result is the honest members' exact mean."""
    g = torch.Generator().manual_seed(1)
    reference, step = torch.randn(1000, generator=g), 0.01 * torch.randn(1000, generator=g)
    honest = reference + step + 0.002 * torch.randn(2, 1000, generator=g)
    rogue = {
        "negated": reference - step,
        "scaled": reference + 3 * step,
        "huge": torch.full((1000,), 1e38),
        "far": reference + 50.0,
        "nan": torch.full((1000,), float("nan")),
    }[attack]
    parts = torch.stack([honest[0], rogue, honest[1]])
    assert torch.allclose(centered_trim(parts), honest.mean(0), atol=1e-6)
    if attack != "nan":
        assert (centered_clip(parts) - honest.mean(0)).norm() > 10 * (
            centered_trim(parts) - honest.mean(0)
        ).norm()


def test_trimming_keeps_a_member_within_the_radius_so_its_pull_is_bounded_by_it():
    g = torch.Generator().manual_seed(2)
    honest = torch.randn(1000, generator=g) + 0.01 * torch.randn(3, 1000, generator=g)
    center = honest.median(0).values
    tau = 2 * (honest - center).norm(dim=1).sort().values[1]
    sneaky = center + 0.9 * tau * torch.ones(1000) / 1000**0.5  # just inside, the same way every round
    parts = torch.cat([honest[:2], sneaky[None]])
    got = centered_trim(parts)
    assert torch.allclose(got, parts.mean(0), atol=1e-6)  # kept: it is within the radius
    assert (got - honest[:2].mean(0)).norm() <= tau  # and pulled no farther than the radius
