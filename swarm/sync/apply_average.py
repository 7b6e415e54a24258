"""Applying a round's average without losing the local steps taken while it was computed: the outer step.

Plain averaging (SPES; ``alpha = 1``, no momentum): theta <- theta + (a - s), where s is the snapshot that
was averaged and a the average: the weights become the average, plus the steps taken meanwhile.

DiLoCo's outer optimizer (``alpha`` < 1 or ``momentum`` > 0): SGD with Nesterov momentum on the outer
gradient, the swarm's progress since the weights the previous round agreed on (the anchor A):

    g = A - a;   m <- mu * m + g;   A <- A - alpha * (g + mu * m);   theta <- A + (theta - s)

The anchor starts as the first snapshot (the first round is then alpha * (a - s) plus momentum) and
moves only when a round is applied; a dropped round leaves it, so the next one's g covers both. A tensor
that only this peer trains (an expert with one holder) takes the same step with a = s: DiLoCo with one
replica, the momentum acting on its own progress.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterStep:
    """Applies averages to named tensors; keeps an anchor and a momentum buffer per name unless plain.

    ``step = OuterStep(alpha=0.7, momentum=0.9)``; ``step.apply(params, snapshot, average)`` edits ``params``
    in place; ``step.apply_listed("dense", params, snapshot, average)`` does it for an item's tensors in order;
    ``step.keep(prefixes)`` forgets the state of names that no longer exist (experts given up).
    """

    def __init__(self, alpha: float = 1.0, momentum: float = 0.0) -> None:
        if not 0 < alpha <= 3 or not 0 <= momentum < 1:
            raise ValueError("alpha must be in (0, 3] and momentum in [0, 1)")
        self.alpha, self.momentum = alpha, momentum
        self.anchors: dict[str, torch.Tensor] = {}  # host fp32: the weights the last applied round agreed on
        self.buffers: dict[str, torch.Tensor] = {}  # host fp32 momentum

    @property
    def plain(self) -> bool:
        """Plain averaging: no state kept between rounds."""
        return self.alpha == 1.0 and self.momentum == 0.0

    @torch.no_grad()
    def apply(
        self,
        params: dict[str, torch.Tensor],
        snapshot: dict[str, torch.Tensor],
        average: dict[str, torch.Tensor],
    ) -> None:
        for name, p in params.items():
            delta = self._delta(name, snapshot[name].float(), average[name].float())
            # computed where the round's tensors are (host memory), copied into a pinned buffer when the model
            # is on a GPU so that the copy to the device runs asynchronously, ordered before the update
            host = torch.empty(p.shape, dtype=torch.float32, pin_memory=p.is_cuda)
            host.copy_(delta)
            p.add_(host.to(p.device, non_blocking=p.is_cuda).to(p.dtype))

    def apply_listed(
        self,
        name: str,
        params: Sequence[torch.Tensor],
        snapshot: Sequence[torch.Tensor],
        average: Sequence[torch.Tensor],
        where: Sequence[int] | None = None,
    ) -> None:
        """``apply`` to an item's tensors in order, named "<name>.<position>"; ``where``: the positions in
        ``params`` that ``snapshot`` and ``average`` hold (default: all), so that a part of the item keeps the
        outer state of the whole's."""
        where = range(len(params)) if where is None else where
        keys = [f"{name}.{i}" for i in where]
        parts = ([params[i] for i in where], snapshot, average)
        self.apply(*(dict(zip(keys, ts, strict=True)) for ts in parts))

    def _delta(self, name: str, snap: torch.Tensor, avg: torch.Tensor) -> torch.Tensor:
        """What to add to the live weights: the new anchor minus the snapshot."""
        if self.plain:
            return avg - snap
        anchor = self.anchors.get(name)
        if anchor is None or anchor.shape != snap.shape:
            anchor = snap.clone()
        grad = anchor - avg
        update = grad
        if self.momentum:
            buf = self.buffers.get(name)
            buf = (
                grad.clone() if buf is None or buf.shape != grad.shape else buf.mul_(self.momentum).add_(grad)
            )
            self.buffers[name] = buf
            update = grad + self.momentum * buf
        self.anchors[name] = anchor = anchor.sub_(self.alpha * update)
        return anchor - snap

    def keep(self, prefixes: set[str]) -> None:
        """Forget anchors and momentum of names whose prefix (before the first '.') is not in ``prefixes``."""
        for state in (self.anchors, self.buffers):
            for name in [n for n in state if n.split(".")[0] not in prefixes]:
                del state[name]
