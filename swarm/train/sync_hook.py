"""The one seam between the local trainer and the swarm.

The trainer calls ``hook.after_step(...)`` after every optimizer step and logs whatever round records it
returns. A networked implementation (the swarm) snapshots, averages and applies weights there; ``NoSync``
serves a solo peer and the tests. The trainer never touches the network itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class StepReport:
    """What the trainer tells the hook after each optimizer step."""

    step: int  # optimizer steps completed
    tokens: int  # tokens processed since the run started
    step_tokens: int  # tokens in this step
    expert_tokens: torch.Tensor  # [E] token copies routed to each expert in this step, all layers
    loss: float
    last: bool = False  # the trainer stops after this step (its step or time limit is reached)


class SyncHook(Protocol):
    def after_step(self, model: torch.nn.Module, report: StepReport) -> list[dict[str, Any]]:
        """Run or advance a synchronisation round; may update ``model``'s weights in place.
        Returns per-round records to append to metrics.jsonl (empty when nothing happened)."""
        ...

    def last_round(self, model: torch.nn.Module, report: StepReport) -> list[dict[str, Any]]:
        """Training is over: complete a last round synchronously (so replicas agree) and return records."""
        ...

    def wanted_experts(self) -> list[int] | None:
        """The experts the swarm wants this peer to train instead of its current ones (an orphan
        re-claim), or None. The trainer then switches and calls ``experts_changed``."""
        ...

    def experts_changed(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


class NoSync:
    """A peer with no swarm: nothing to average. Used by ``swarm-peer --solo``."""

    def after_step(self, model: torch.nn.Module, report: StepReport) -> list[dict[str, Any]]:
        return []

    def last_round(self, model: torch.nn.Module, report: StepReport) -> list[dict[str, Any]]:
        return []

    def wanted_experts(self) -> list[int] | None:
        return None

    def experts_changed(self, model: torch.nn.Module) -> None:
        pass

    def close(self) -> None:
        pass
