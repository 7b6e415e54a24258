"""Aggregation rules: how the contributions of a group's members become one average.

    rule = aggregation_rule("centered_clip", clip_factor=2.0)   # None for "mean": hivemind's plain mean
    part = rule(torch.stack([a, b, c]))                         # [members, values] -> [values]

``centered_clip`` takes the coordinate-wise median of the members'
contributions as the centre, measures each member's distance from it, and averages the members' offsets
from the centre after clipping each to ``tau = clip_factor x the median member's distance``: the result is
never farther than ``tau`` from the centre. While fewer than half the members are rogue, the centre lies,
coordinate by coordinate, between honest members' values and ``tau`` is at most ``clip_factor`` times an
honest member's distance from it; so the bound on a rogue member's pull comes from how far the honest members'
own updates spread, not from a fixed multiple of the weights. Honest members whose offsets are within
``tau`` (nearly always, with the default factor 2) get the exact mean. Members whose contribution has a NaN
or inf are left out. This is one step of centered clipping (Karimireddy, He and Jaggi, ICML 2021), the rule
that BTARD (Gorbunov et al., arXiv 2106.11257) runs inside each reducer of hivemind's butterfly all-reduce;
coordinate-wise trimmed means need more members than our groups of 2-4 usually have, and a plain median
throws away most of the honest information when there are only three.

``centered_trim`` is the open swarm's default: the same centre and radius, but a member farther than ``tau``
is left out and the others averaged exactly. Clipping alone bounds a rogue's pull in one round by
``tau / n``, but a rogue that pushes the same way every round (all weights towards 1e38, or its update
scaled up) adds that pull round after round: measured with real processes (``benchmarks/attacks.py``, demo
config, 3 members), centered clipping let a 1e38 member take the honest peers' validation loss from 4.80 to
5.95 and a 3x-scaled one to 5.01, while trimming leaves such members out entirely. What stays possible is
a member just inside ``tau`` every round, which moves the result by at most ``tau / n`` a round, the same
bound as clipping. The kept members are at least the lower half (their distances are at most the median
one), so with honest members within the radius (nearly always, with the default factor 2) it is the exact
mean.

Every member counts equally: a member's weight is something it reports about itself, so a rogue one could
claim any.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

AGGREGATIONS = ("mean", "centered_clip", "centered_trim")
AggregationRule = Callable[[torch.Tensor], torch.Tensor]


SORTING_NETWORK_MAX = 8  # up to this many members, an odd-even transposition sort of whole rows is faster


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """The median along dim 0 (the mean of the two middle values for an even count), NaN-free input."""
    n = x.shape[0]
    if n > SORTING_NETWORK_MAX:
        rows = list(x.sort(dim=0).values)
    else:  # torch.sort along the short, strided dim is ~5x slower than n passes of elementwise min/max
        rows = list(x)
        for p in range(n):
            for i in range(p % 2, n - 1, 2):
                rows[i], rows[i + 1] = (
                    torch.minimum(rows[i], rows[i + 1]),
                    torch.maximum(rows[i], rows[i + 1]),
                )
    return (rows[(n - 1) // 2] + rows[n // 2]) / 2


def centered_clip(parts: torch.Tensor, clip_factor: float = 2.0) -> torch.Tensor:
    """The members' ``parts`` ([members, ...]) aggregated as the module docstring says; all NaN if no member
    sent finite values (a result that every check downstream refuses)."""
    x = parts.reshape(parts.shape[0], -1).double()
    finite = torch.isfinite(x.sum(dim=1))  # any NaN or inf makes a row's sum so; fp32 values cannot, in fp64
    if not bool(finite.all()):
        x = x[finite]
    if x.shape[0] == 0:
        return torch.full(parts.shape[1:], float("nan"), dtype=parts.dtype)
    center = coordinate_median(x)
    offsets = x - center
    distance = offsets.norm(dim=1)
    tau = clip_factor * distance.sort().values[(x.shape[0] - 1) // 2]  # the lower middle: no rogue's
    scale = torch.where(distance > tau, tau / distance.clamp_min(1e-300), torch.ones_like(distance))
    result = center + (offsets * scale[:, None]).mean(dim=0)
    return result.to(parts.dtype).reshape(parts.shape[1:])


def centered_trim(parts: torch.Tensor, clip_factor: float = 2.0) -> torch.Tensor:
    """Centered clipping's centre and radius ``tau``, but a member farther than ``tau`` from the centre is
    left out instead of clipped, and the rest are averaged exactly (see the module docstring)."""
    x = parts.reshape(parts.shape[0], -1).double()
    x = x[torch.isfinite(x.sum(dim=1))]
    if x.shape[0] == 0:
        return torch.full(parts.shape[1:], float("nan"), dtype=parts.dtype)
    center = coordinate_median(x)
    distance = (x - center).norm(dim=1)
    tau = clip_factor * distance.sort().values[(x.shape[0] - 1) // 2]  # the lower middle: no rogue's
    kept = x[distance <= tau]  # the lower half at least: tau >= their distances
    return kept.mean(dim=0).to(parts.dtype).reshape(parts.shape[1:])


def aggregation_rule(name: str, clip_factor: float = 2.0) -> AggregationRule | None:
    """The rule called ``name`` (``AGGREGATIONS``); None for the plain mean (hivemind's own reduction)."""
    if name == "mean":
        return None
    if name == "centered_clip":
        return functools.partial(centered_clip, clip_factor=clip_factor)
    if name == "centered_trim":
        return functools.partial(centered_trim, clip_factor=clip_factor)
    raise ValueError(f"unknown aggregation rule {name!r}: one of {', '.join(AGGREGATIONS)}")
