"""Every wait of the swarm layer, derived once from the sync config so that each bound has one name.

timing = Timing.from_config(cfg.sync)
group.outcome(control, timeout=timing.round_s)
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import SyncConfig


@dataclass(frozen=True)
class Timing:
    matchmaking_s: float  # how long a round waits for partners to show up
    round_s: float  # a round (matchmaking, all-reduce, checks, downloads) never takes longer
    download_s: float  # one download of a tensor group
    heartbeat_s: float  # the heartbeat period; readers call a peer stale after two missed periods
    request_s: float  # one averaging request or streamed chunk
    final_agreement_s: float  # one step of the final agreement (a digest read, a download)
    # how late a member of a group met before the slot (``sync.prematch_s``) may begin its all-reduce and
    # still be waited for: in a group met at the slot, one that late would have missed the matchmaking window
    late_s: float = 0.0

    @classmethod
    def from_config(cls, sc: SyncConfig) -> Timing:
        return cls(
            matchmaking_s=sc.matchmaking_s,
            round_s=sc.round_timeout_s,
            download_s=sc.download_timeout_s,
            heartbeat_s=sc.heartbeat_s,
            request_s=min(3.0, sc.matchmaking_s / 2),
            final_agreement_s=min(10.0, sc.round_timeout_s / 3),
            late_s=sc.matchmaking_s if sc.prematch_window_s > 0 else 0.0,
        )

    @property
    def record_ttl_s(self) -> float:
        """Heartbeats expire after three periods: a peer that stops publishing is gone soon after."""
        return 3 * self.heartbeat_s

    @property
    def ordinary_matchmaking_s(self) -> float:
        """How long an ordinary round's averaging step may look for a group."""
        return self.matchmaking_s + self.round_s / 4

    @property
    def final_window_s(self) -> float:
        """Peers reach the final agreement up to a round apart (a late one may still have been in a round)."""
        return self.final_wait_s + 2 * self.final_agreement_s

    @property
    def final_wait_s(self) -> float:
        """How long the final agreement waits at most for a live finishing holder's digests: that holder may
        first wait for the round it had in flight when it stopped (``join_round_s``), then take its last
        round (matchmaking, then up to a round), while ours was short (alone, nobody to wait for)."""
        return self.join_round_s + self.matchmaking_s + self.round_s

    @property
    def quorum_grace_s(self) -> float:
        """How long a majority of a group that agree wait for a silent member's digest (round_consensus)."""
        return min(3.0, self.round_s / 10)

    @property
    def join_round_s(self) -> float:
        """How long leaving waits for a round in flight to end (its own timeout, plus a margin)."""
        return self.round_s + 5
