"""Every peer the dashboard has seen, with its state (online, stale, offline) and swarm-wide counters.

    table = PeerTable(max_offline=64)
    table.observe(read_heartbeats(dht, run_id), now=time.time())   # after every DHT read
    rows = table.rows(now=time.time())                             # one dict per peer, for the page and API

A peer is *online* while its record is in the DHT and was published at most two of its heartbeat periods
ago, *stale* while its record is still there but older, and *offline* once the dashboard has seen it before
and its record is gone (expired, or withdrawn by a peer that left). The state is computed at the time asked,
from the publication time in the record, so a killed peer turns stale on time however rarely the DHT is
polled. Offline peers stay listed (the most recent ``max_offline`` of them) so that users see who left.

Counters (rounds, bytes, tokens) add up what each peer's cumulative record grew by since the last read, so
they only grow, as Prometheus counters must, even when a peer restarts from zero or is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing swarm.net loads hivemind (seconds): only the poller needs it at run time
    from swarm.net.records import Heartbeat

ONLINE, STALE, OFFLINE = "online", "stale", "offline"
STATUS_ORDER = {ONLINE: 0, STALE: 1, OFFLINE: 2}
COUNTERS = ("rounds_ok", "rounds_failed", "bytes_sent", "bytes_recv", "tokens")


def short_id(peer_id: str) -> str:
    """The tail of a peer id: libp2p ids share their first characters ("12D3KooW..."), not their last."""
    return peer_id[-8:]


@dataclass
class PeerEntry:
    peer_id: str
    hb: Heartbeat
    expiration: float  # DHT time at which the record expires
    first_seen: float
    last_seen: float  # DHT time of the last read that returned the record
    present: bool = True  # the last successful read returned it
    gone_at: float | None = None  # when a read first missed it

    def period(self, default_period_s: float) -> float:
        """The peer's heartbeat period: from the record, else from its TTL (three periods), else a default."""
        if self.hb.period_s and self.hb.period_s > 0:
            return float(self.hb.period_s)
        if self.hb.sent_at is not None and self.expiration > self.hb.sent_at:
            return (self.expiration - self.hb.sent_at) / 3.0
        return default_period_s

    def status(self, now: float, default_period_s: float) -> str:
        if not self.present or self.expiration <= now:
            return OFFLINE
        if self.hb.sent_at is None:  # an older peer that does not say when it published: trust the TTL
            return ONLINE
        return ONLINE if now - self.hb.sent_at <= 2 * self.period(default_period_s) else STALE


@dataclass
class PeerTable:
    """The peers seen so far and the swarm's counters. Not thread-safe: the caller holds a lock."""

    max_offline: int = 64
    default_period_s: float = 5.0
    peers: dict[str, PeerEntry] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def observe(self, beats: dict[str, tuple[Heartbeat, float]], now: float) -> bool:
        """Merge one DHT read. Returns False when the read is taken for a failed one (see below)."""
        # read_heartbeats answers {} both for "no records" and for "the DHT did not answer": an empty read
        # while records we know of have not expired yet is a failed read, not a swarm that vanished.
        for entry in self.peers.values():
            if entry.present and entry.expiration <= now:
                self._gone(entry, now)
        if not beats and any(e.present for e in self.peers.values()):
            return False
        for pid, (hb, expiration) in beats.items():
            entry = self.peers.get(pid)
            if entry is None:
                self._count(None, hb)
                entry = self.peers[pid] = PeerEntry(pid, hb, expiration, now, now)
            else:
                self._count(entry.hb, hb)
            entry.hb, entry.expiration, entry.last_seen = hb, expiration, now
            entry.present, entry.gone_at = True, None
        for pid, entry in self.peers.items():
            if entry.present and pid not in beats:
                self._gone(entry, now)
        self._forget_oldest_offline()
        return True

    def _gone(self, entry: PeerEntry, now: float) -> None:
        entry.present, entry.gone_at = False, now

    def _count(self, old: Heartbeat | None, new: Heartbeat) -> None:
        for name in COUNTERS:
            before, after = int(getattr(old, name, 0) or 0), int(getattr(new, name) or 0)
            # a counter that went down is a peer that restarted: it counts again from zero
            self.totals[name] += after - before if after >= before else after

    def _forget_oldest_offline(self) -> None:
        offline = sorted((e.gone_at or 0.0, pid) for pid, e in self.peers.items() if not e.present)
        for _, pid in offline[: max(0, len(offline) - self.max_offline)]:
            del self.peers[pid]

    def statuses(self, now: float) -> dict[str, str]:
        return {pid: e.status(now, self.default_period_s) for pid, e in self.peers.items()}

    def rows(self, now: float) -> list[dict[str, Any]]:
        """One row per peer for the page and /api/state: online first, then stale, then offline. ``now`` is
        DHT time, which in hivemind is the wall clock, so it also dates ``last_round_time``."""
        out = []
        for pid, e in self.peers.items():
            hb, status = e.hb, e.status(now, self.default_period_s)
            rounds = int(hb.rounds_ok) + int(hb.rounds_failed)
            moved = int(hb.bytes_sent) + int(hb.bytes_recv)
            out.append(
                {
                    "peer_id": pid,
                    "short_id": short_id(pid),
                    "status": status,
                    "state": hb.state,
                    "experts": sorted(hb.experts),
                    "step": hb.step,
                    "tokens": hb.tokens,
                    "loss": hb.loss,
                    "tokens_per_s": hb.tokens_per_s,
                    "last_round": hb.last_round,
                    "last_round_age_s": (
                        None if hb.last_round_time is None else max(0.0, now - hb.last_round_time)
                    ),
                    "rounds_ok": hb.rounds_ok,
                    "rounds_failed": hb.rounds_failed,
                    "bytes_sent": hb.bytes_sent,
                    "bytes_recv": hb.bytes_recv,
                    "bytes_per_round": moved // rounds if rounds else None,
                    "period_s": e.period(self.default_period_s),
                    "sent_at": hb.sent_at,
                    "age_s": None if hb.sent_at is None else max(0.0, now - hb.sent_at),
                    "addrs": list(hb.addrs),
                    "expires_in_s": max(0.0, e.expiration - now) if e.present else None,
                    "first_seen": e.first_seen,
                    "last_seen": e.last_seen,
                    "gone_at": e.gone_at,
                }
            )
        out.sort(key=lambda r: (STATUS_ORDER[r["status"]], r["peer_id"]))
        return out
