"""``RoundRecord``: what one synchronisation round did, as the trainer logs it to metrics.jsonl.

    rec = RoundRecord(step=100, round=3, applied=True, dense_group=4, applied_groups=["dense"])
    metrics.write(**rec.to_dict())
    rec = RoundRecord.from_dict(json.loads(line))     # the demo, the dashboard and the tests read it back

A record with ``reason`` set is a sync point where no round started (e.g. the previous one was still in
flight). ``last`` marks the last round, which every peer of a run takes together before it stops.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RoundRecord:
    step: int
    round: int | None = None
    applied: bool = False
    reason: str = ""  # why no round started at this sync point; "" when one ran
    last: bool = False
    dense_group: int = 0  # members of the dense (or core) group (1: averaged alone, i.e. not at all)
    expert_groups: dict[str, int] = field(default_factory=dict)  # expert -> members of its group
    members: dict[str, list[str]] = field(default_factory=dict)  # group item -> member id tails
    rejected: list[str] = field(default_factory=list)  # each failure: which group or expert, and why
    download_failures: list[str] = field(default_factory=list)
    downloaded: list[int] = field(default_factory=list)
    applied_groups: list[str] = field(default_factory=list)  # "dense" (or "core"), "expert3", ...
    merge_alpha: float | None = None
    bytes_sent: int = 0  # payload by arithmetic: all-reduce parts and downloads
    bytes_recv: int = 0
    wire_bytes: int | None = None  # measured at our p2pd, both directions, overhead included
    host_bytes: int = 0  # host memory the round held until applied
    sync_seconds: float = 0.0
    started_at: float | None = None  # wall clock (time.time()) at the round's start
    # where the round's time went: "matchmaking" (until the first group formed: waiting for its members;
    # on hivemind seen only once every group started, so never under ``startup_s``),
    # "allreduce" (until every group's outcome is in; "groups" for both when no group formed), "checks"
    # (publishing our digests, awaiting the others', tensor checks), "downloads" (the wait for the non-local
    # experts' downloads after that: they run alongside the groups, from the round's start or once the groups
    # have their members: sync.downloads_after_matchmaking),
    # "merge"
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # what the checks took, summed over the round's groups: "digest" (ours computed) and "publish" (stored
    # in the DHT; with several groups, all but the last group's fall in "allreduce"), "await" (the other
    # members' digests), "verify" (decoding, tensor checks, commit), "serve" (our new copies handed to the
    # groups that serve them)
    check_seconds: dict[str, float] = field(default_factory=dict)
    met_early: list[str] = field(default_factory=list)  # groups whose members met before the slot (prematch)
    # seconds into the round every group had started and our experts' new copies were served (our own
    # start-up work: snapshots read, payloads encoded; the groups' members meanwhile meet or all-reduce)
    startup_s: float | None = None
    # where that start-up went, summed over the round's groups: "encode" (payloads encoded, our round info),
    # "start" (groups started, or met-early ones triggered), "serve" (our experts' new copies served: what
    # downloaders wait for), "residuals" (error feedback's, taken while the groups all-reduce)
    startup_seconds: dict[str, float] = field(default_factory=dict)
    downloads_began_s: float | None = None  # seconds into the round the downloads began (refresh rounds)
    downloads_ended_s: float | None = None  # ... and ended
    downloads_waited_s: float | None = None  # the longest a holder's copy was waited for to be fresh
    wire_total: int | None = None  # our p2pd's count (both directions) at the round's end, since we started
    final_adopted: list[str] = field(default_factory=list)  # after the last round: copies replaced
    final_unsettled: list[str] = field(default_factory=list)
    final_downloaded: list[int] = field(default_factory=list)  # non-local experts' final copies fetched

    @property
    def started(self) -> bool:
        return not self.reason

    @property
    def clean(self) -> bool:
        """A round that ran, applied something and had no failure."""
        return self.started and self.applied and not self.rejected

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.reason:  # a skipped sync point: only what says so
            return {k: out[k] for k in ("step", "round", "applied", "reason") if k in out}
        return out

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> RoundRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in known})

    @staticmethod
    def is_round(value: dict[str, Any]) -> bool:
        """Whether a metrics line is a round record (a started round or a skipped sync point)."""
        return "reason" in value or "dense_group" in value
