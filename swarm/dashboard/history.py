"""The time series behind the page's charts, kept by the dashboard process in a bounded ring buffer.

    history = History(max_samples=900)                       # 30 minutes at one sample every 2 s
    history.add(now, {"12D3...": (2.31, 5400.0)})            # per peer: (loss, tokens/s), after every read
    series = history.to_dict(peer_ids=[...])                 # arrays aligned on "t", null where unknown

The DHT holds only each peer's latest heartbeat, so the past exists only here: a dashboard that starts late
draws from the moment it started. Memory is bounded by ``max_samples`` times the peers in a sample.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    t: float  # DHT (wall clock) time of the read
    tokens_per_s: float  # sum over the peers that were online and training
    loss: float | None  # mean over those peers that report a loss
    peers: dict[str, tuple[float | None, float]] = field(default_factory=dict)  # id -> (loss, tokens/s)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


class History:
    """A ring buffer of samples. Not thread-safe: the caller holds a lock."""

    def __init__(self, max_samples: int = 900) -> None:
        if max_samples < 2:
            raise ValueError("max_samples must be >= 2 (a line needs two points)")
        self.samples: deque[Sample] = deque(maxlen=max_samples)

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, t: float, training: dict[str, tuple[float | None, float]]) -> Sample:
        """Record one read: ``training`` maps each online, training peer to its (loss, tokens/s)."""
        peers = {pid: (_finite(loss), _finite(tps) or 0.0) for pid, (loss, tps) in training.items()}
        losses = [loss for loss, _ in peers.values() if loss is not None]
        sample = Sample(
            t=t,
            tokens_per_s=sum(tps for _, tps in peers.values()),
            loss=sum(losses) / len(losses) if losses else None,
            peers=peers,
        )
        self.samples.append(sample)
        return sample

    def to_dict(self, peer_ids: list[str] | None = None) -> dict[str, Any]:
        """Columns for the charts. Per-peer series only for ``peer_ids`` (default: every peer in the buffer)
        and only for peers with at least one value, so a long-gone peer costs nothing."""
        samples = list(self.samples)
        wanted = peer_ids if peer_ids is not None else sorted({p for s in samples for p in s.peers})
        peers: dict[str, dict[str, list[float | None]]] = {}
        for pid in wanted:
            values = [s.peers.get(pid) for s in samples]
            if any(v is not None for v in values):
                peers[pid] = {
                    "loss": [None if v is None else v[0] for v in values],
                    "tokens_per_s": [None if v is None else v[1] for v in values],
                }
        return {
            "t": [s.t for s in samples],
            "tokens_per_s": [s.tokens_per_s for s in samples],
            "loss": [s.loss for s in samples],
            "peers": peers,
        }
