"""The one seam between the local trainer and the swarm.

The trainer calls ``hook.after_step(...)`` after every optimizer step and logs whatever round records it
returns (``SyncReply``). A networked implementation (the swarm) snapshots, averages and applies weights there; ``NoSync``
serves a solo peer and the tests. The trainer never touches the network itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarm.train.round_record import RoundRecord


@dataclass
class StepReport:
    """What the trainer tells the hook after each optimizer step."""

    step: int  # optimizer steps completed
    tokens: int  # tokens processed since the run started
    step_tokens: int  # tokens in this step
    expert_tokens: torch.Tensor  # [E] token copies routed to each expert in this step, all layers
    loss: float
    last: bool = False  # the trainer stops after this step (its step or time limit is reached)
    steps_left: int | None = None  # until the step limit (None: unknown)


@dataclass(frozen=True)
class Pools:
    """How many replicas average this peer's weights: the peers training (its dense weights), the holders
    of its experts (the fewest of any of them). ``train.pooled_moment`` sizes AdamW's second moment by it."""

    dense: int = 1
    experts: int = 1


@dataclass(frozen=True)
class SyncReply:
    """What the hook hands back after a step: round records to log, and the experts the swarm wants this
    peer to train from now on (an orphan re-claim), or None. The trainer switches, then calls
    ``experts_changed``. ``pools``: the swarm as the hook sees it now (None: unchanged)."""

    records: list[RoundRecord] = field(default_factory=list)
    switch_to: list[int] | None = None
    pools: Pools | None = None


class SyncHook(Protocol):
    def after_step(self, model: torch.nn.Module, report: StepReport) -> SyncReply:
        """Run or advance a synchronisation round; may update ``model``'s weights in place."""
        ...

    def last_round(self, model: torch.nn.Module, report: StepReport) -> list[RoundRecord]:
        """Training is over: complete a last round synchronously (so replicas agree) and return records."""
        ...

    def experts_changed(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


class NoSync:
    """A peer with no swarm: nothing to average. Used by ``swarm-peer --solo``."""

    def after_step(self, model: torch.nn.Module, report: StepReport) -> SyncReply:
        return SyncReply()

    def last_round(self, model: torch.nn.Module, report: StepReport) -> list[RoundRecord]:
        return []

    def experts_changed(self, model: torch.nn.Module) -> None:
        pass

    def close(self) -> None:
        pass
