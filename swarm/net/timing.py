"""Every wait of the swarm layer, derived once from the sync config so that each bound has one name.

timing = Timing.from_config(cfg.sync)
group.outcome(control, timeout=timing.round_s)
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import SyncConfig

MIN_LOOK_S = 0.1  # a round begun too late in its slot to meet anyone fails at once instead


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
    slot_s: float = 0.0  # ``sync.sync_every_s``: rounds on the wall clock (0: on steps)
    meet_early_s: float = 0.0  # how long before its slot a round's groups meet (``prematch_window_s``)

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
            slot_s=sc.sync_every_s,
            meet_early_s=sc.prematch_window_s,
        )

    @property
    def record_ttl_s(self) -> float:
        """Heartbeats expire after three periods: a peer that stops publishing is gone soon after."""
        return 3 * self.heartbeat_s

    @property
    def ordinary_matchmaking_s(self) -> float:
        """How long an ordinary round's averaging step may look for a group."""
        return self.matchmaking_s + self.round_s / 4

    def last_ordinary_start(self, last_round_at: float) -> float:
        """The wall time after which no peer given this last round's time starts an ordinary round: one
        started later could still be looking for members when the last round is due to begin, and a peer
        still in it then misses that round (``SwarmSync``'s ``_near_last_round``)."""
        return last_round_at - self.matchmaking_s - self.ordinary_matchmaking_s

    def matchmaking_left(self, slot: int | None, now: float) -> float:
        """How long, from wall time ``now``, an ordinary round of wall-clock slot ``slot`` (None: rounds on
        steps), or a group met early for it, may look for members: ``ordinary_matchmaking_s``, but never
        into the next slot's meeting. Every slot's groups have the same names, so a round still looking
        then joins them: in a demo, a peer's first round, begun 2.6 s into a slot that the others had not
        started, joined at 11.3 s the groups they had met for the next slot."""
        next_meeting = self.next_meeting(slot)
        if next_meeting is None:
            return self.ordinary_matchmaking_s
        return max(MIN_LOOK_S, min(self.ordinary_matchmaking_s, next_meeting - now))

    def next_meeting(self, slot: int | None) -> float | None:
        """The wall time at which the next slot's groups may start to meet, less a margin for clocks that
        differ between peers and for requests already under way (None: rounds on steps)."""
        if slot is None or self.slot_s <= 0:
            return None
        return (slot + 1) * self.slot_s - self.meet_early_s - min(1.0, self.slot_s / 10)

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
