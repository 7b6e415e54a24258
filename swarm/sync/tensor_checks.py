"""Checks every averaged or downloaded tensor passes before it touches the model.

hivemind lets NaN and huge values through and trusts each sender's weight (see NOTES.md), so a peer
verifies shape, dtype, finiteness and distance from its own copy, and clamps the weights it reports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

K = TypeVar("K")


class RejectedTensor(ValueError):
    """A received tensor failed a check; the message names the tensor and the reason."""


def check_tensor(name: str, received: torch.Tensor, local: torch.Tensor, max_rel_distance: float) -> None:
    """Raise RejectedTensor unless ``received`` has ``local``'s shape, is finite, and
    ||received - local|| <= max_rel_distance * (||local|| + 1e-6)."""
    dist, norm, _, _ = _measure(name, received, local)
    _bound(name, dist, norm, max_rel_distance)


def check_tensors(
    name: str, received: list[torch.Tensor], local: list[torch.Tensor], max_rel_distance: float
) -> None:
    """``check_tensor`` on each of a group's tensors (``name[i]``), after checking that the counts match."""
    CopyComparison.of(name, received, local).check(max_rel_distance)


def _measure(label: str, got: torch.Tensor, mine: torch.Tensor) -> tuple[float, float, float, float]:
    """(||got - mine||, ||mine||, ||got||^2, <got, mine>), each in one pass over the values, after the
    checks that need no distance: shape, dtype, finiteness."""
    if tuple(got.shape) != tuple(mine.shape):
        raise RejectedTensor(f"{label}: shape {tuple(got.shape)}, expected {tuple(mine.shape)}")
    if not got.is_floating_point():
        raise RejectedTensor(f"{label}: dtype {got.dtype} is not floating point")
    r = got.detach().reshape(-1).float()
    o = mine.detach().reshape(-1).to(r.device, torch.float32)  # ours may live on a GPU, in bf16
    sq = float(torch.dot(r, r))  # finite unless a value is not (or the sum overflows: look again)
    if not math.isfinite(sq) and not bool(torch.isfinite(r).all()):
        raise RejectedTensor(f"{label}: contains NaN or inf")
    diff = r - o
    return (
        math.sqrt(float(torch.dot(diff, diff))),
        math.sqrt(float(torch.dot(o, o))),
        sq,
        float(torch.dot(r, o)),
    )


def _bound(label: str, dist: float, norm: float, max_rel_distance: float) -> None:
    scale = norm + 1e-6
    if not dist <= max_rel_distance * scale:
        raise RejectedTensor(f"{label}: relative distance {dist / scale:.3g} exceeds {max_rel_distance}")


@dataclass(frozen=True)
class CopyComparison:
    """A received copy (a group of tensors) against ours, with each sum the checks of a downloaded copy read
    taken once: ``check`` (``check_tensors``' bound), ``relative_change`` and, for ``copy_doubt``'s rule
    (``norm_doubt``), ``received_norm``, ``norm`` and ``dot``. A round downloads a dozen experts on a
    thread of the process that trains: taken apart, the three checks passed over each copy about 19 times,
    against 6 here (``benchmarks/round_cpu.py``).

        cmp = CopyComparison.of("expert3", received, ours)  # RejectedTensor: count, shape, dtype, NaN/inf
        cmp.check(max_rel_distance=4.0)                     # RejectedTensor: a tensor too far from ours
    """

    name: str
    distances: tuple[float, ...]  # ||received - ours||, per tensor
    norms: tuple[float, ...]  # ||ours||, per tensor
    received_sq: float  # the sum of ||received||^2
    dot: float  # the sum of <received, ours>

    @classmethod
    def of(cls, name: str, received: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> CopyComparison:
        if len(received) != len(local):
            raise RejectedTensor(f"{name}: {len(received)} tensors, expected {len(local)}")
        pairs = enumerate(zip(received, local, strict=True))
        measured = [_measure(f"{name}[{i}]", got, mine) for i, (got, mine) in pairs]
        return cls(
            name,
            tuple(m[0] for m in measured),
            tuple(m[1] for m in measured),
            sum(m[2] for m in measured),
            sum(m[3] for m in measured),
        )

    def check(self, max_rel_distance: float) -> None:
        """Raise RejectedTensor unless every tensor is within ``max_rel_distance`` of ours, as
        ``check_tensor`` bounds it: ||received - local|| <= max_rel_distance * (||local|| + 1e-6)."""
        for i, (dist, norm) in enumerate(zip(self.distances, self.norms, strict=True)):
            _bound(f"{self.name}[{i}]", dist, norm, max_rel_distance)

    @property
    def relative_change(self) -> float:
        """``relative_change(received, ours)``."""
        diff = sum(d * d for d in self.distances)
        return (diff / max(sum(n * n for n in self.norms), 1e-12)) ** 0.5

    @property
    def norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.norms))

    @property
    def received_norm(self) -> float:
        return math.sqrt(self.received_sq)


def clamp_weight(weight: float, max_weight: float) -> float:
    """Round weights are token counts: never negative, never above what one peer can plausibly process."""
    if weight != weight:  # NaN
        return 0.0
    return float(min(max(weight, 0.0), max_weight))


# a copy that moved less than its own norm is never called an outlier: early in training an honest expert
# changed by 0.8 of its norm in one demo round (25 steps) while the median of its fetch was 0.17. Zeroed,
# negated and scaled copies are told by their norm and direction (``copy_doubt``) whatever their change.
MIN_SUSPECT_CHANGE = 1.0
CHANGE_FACTOR = 4.0  # an outlier moved more than this x the median copy of the same fetch


def relative_change(new: list[torch.Tensor], old: list[torch.Tensor]) -> float:
    """||new - old|| / ||old|| over a group of tensors (ours may live on a GPU, in bf16)."""
    diff = sum(
        float((n.float() - o.detach().to(n.device, torch.float32)).pow(2).sum())
        for n, o in zip(new, old, strict=True)
    )
    norm = sum(float(o.detach().float().pow(2).sum()) for o in old)
    return (diff / max(norm, 1e-12)) ** 0.5


def outlying_changes(
    changes: Mapping[K, float], factor: float = CHANGE_FACTOR, floor: float = MIN_SUSPECT_CHANGE
) -> tuple[set[K], float]:
    """(the keys whose change is above ``factor`` x the median change and above ``floor``, the median).
    Copies of different experts fetched together move alike (same steps, same learning rate): one that
    moved far more than the others was negated, zeroed or scaled by whoever served it. With fewer than
    three changes there is no majority to compare with, and nothing is called an outlier."""
    if len(changes) < 3:
        return set(), float("nan")
    values = sorted(changes.values())
    median = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
    bound = max(floor, factor * median)
    return {k for k, c in changes.items() if not c <= bound}, median
