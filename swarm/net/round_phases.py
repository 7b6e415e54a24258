"""Where a round's time goes: ``phase_seconds`` of its record, phase after phase.

phases = Phases(record, t0)
phases.end("matchmaking", at=formed)   # record.phase_seconds["matchmaking"] = formed - t0
phases.end("allreduce")                # ... = now - formed
"""

from __future__ import annotations

import time

from swarm.train.round_record import RoundRecord


class Phases:
    """Writes how long each phase of a round took into its record (``phase_seconds``)."""

    def __init__(self, rec: RoundRecord, t0: float) -> None:
        self.rec, self.mark = rec, t0

    def end(self, phase: str, at: float | None = None) -> None:
        now = time.monotonic() if at is None else max(self.mark, at)
        self.rec.phase_seconds[phase] = round(now - self.mark, 3)
        self.mark = now
