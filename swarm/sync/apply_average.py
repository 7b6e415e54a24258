"""Applying a round's average without losing the local steps taken while it was computed.

theta <- theta + alpha * (a - s), where s is the snapshot that was averaged and a the average. With
outer momentum mu (Nesterov, as DiLoCo), the outer "gradient" d = a - s drives a momentum buffer
m <- mu * m + d and the update is alpha * (d + mu * m).
"""

from __future__ import annotations

import torch


class OuterStep:
    """Applies averages to named tensors; keeps one momentum buffer per name when momentum > 0.

    ``step = OuterStep(alpha=1.0)``; ``step.apply(params, snapshot, average)`` edits ``params`` in place.
    """

    def __init__(self, alpha: float = 1.0, momentum: float = 0.0) -> None:
        if not 0 < alpha <= 1 or not 0 <= momentum < 1:
            raise ValueError("alpha must be in (0, 1] and momentum in [0, 1)")
        self.alpha, self.momentum = alpha, momentum
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def apply(
        self,
        params: dict[str, torch.Tensor],
        snapshot: dict[str, torch.Tensor],
        average: dict[str, torch.Tensor],
    ) -> None:
        for name, p in params.items():
            # the difference where the round's tensors are (host memory), into a pinned buffer when the model
            # is on a GPU so that the copy to the device runs asynchronously, ordered before the update
            host = torch.empty(p.shape, dtype=torch.float32, pin_memory=p.is_cuda)
            torch.sub(average[name].float(), snapshot[name].float(), out=host)
            delta = host.to(p.device, non_blocking=p.is_cuda)
            if self.momentum:
                buf = self.buffers.get(name)
                buf = delta.clone() if buf is None else buf.mul_(self.momentum).add_(delta)
                self.buffers[name] = buf
                delta = delta + self.momentum * buf
            p.add_((self.alpha * delta).to(p.dtype))
