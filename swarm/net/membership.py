"""This peer's heartbeat and its view of the swarm: who is live, who holds which expert, which are orphans.

    members = Membership(store, me, "demo", timing, experts=[0, 1, 2, 3], n_experts=16, orphan_grace_s=60.0)
    members.view.holders[5]                  # an immutable view, swapped in whole after each read
    members.report_step(step, tokens, loss, step_tokens)
    members.claimed                          # experts claimed for an orphan but not switched to yet, or None
    members.set_experts([0, 2, 3, 5])        # after the trainer switched
    members.record_round(rec)                # a round's outcome, for the heartbeat
    members.close()                          # stops the thread and withdraws the heartbeat at once

A thread publishes the heartbeat at a fixed cadence (readers call a peer stale after two missed periods, so
a loaded machine's DHT latency must not stretch the period), reads everyone's, and decides orphan claims
(DESIGN: "Joining, claiming, leaving"). Other threads read ``view`` without a lock: it is never edited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from swarm.net.records import (
    Heartbeat,
    expert_holders,
    publish_heartbeat,
    read_records,
    withdraw_heartbeat,
)
from swarm.net.timing import Timing
from swarm.net.transport import Store
from swarm.sync import orphan_claim_rank, orphan_swap
from swarm.train.round_record import RoundRecord


@dataclass(frozen=True)
class MembershipView:
    """The swarm as of one heartbeat read. ``orphaned_since``: expert -> monotonic time since when it has
    had no live holder; ``heard_at``: peer -> monotonic time at which a new heartbeat of it was first read;
    ``read_at``: when the read behind this view was made."""

    peers: Mapping[str, Heartbeat] = field(default_factory=dict)
    holders: Mapping[int, frozenset[str]] = field(default_factory=dict)
    orphaned_since: Mapping[int, float] = field(default_factory=dict)
    heard_at: Mapping[str, float] = field(default_factory=dict)
    read_at: float = 0.0

    def silent_for(self, peer: str) -> float:
        """For how long ``peer`` had published no new heartbeat when this view was read; 0.0 for a peer
        never heard of (nothing is known of it). On our own clock (another peer's may be off by any amount),
        and up to our last successful read only: reads that fail (our DHT is slow) make nobody silent."""
        heard = self.heard_at.get(peer)
        return 0.0 if heard is None else max(0.0, self.read_at - heard)

    def partners(self, me: str, ordinary: bool = False, joining: bool = False) -> list[str]:
        """The other peers that may average with us now: training, or in their last round (a joiner has not
        caught up yet, and a peer that is done averages no more). For an ``ordinary`` round, those training:
        a peer in its last round meets only last rounds. ``joining``: joiners too (they will average soon)."""
        states = ("training",) if ordinary else ("training", "finishing")
        states += ("joining",) if joining else ()
        return [p for p, hb in self.peers.items() if p != me and hb.state in states]

    def step_of(self, peer: str) -> int:
        hb = self.peers.get(peer)
        return hb.step if hb is not None else 0


class Membership:
    """See the module docstring."""

    def __init__(
        self,
        store: Store,
        me: str,
        run_id: str,
        timing: Timing,
        experts: list[int],
        n_experts: int,
        orphan_grace_s: float,
        addrs: list[str] | None = None,
    ) -> None:
        """``addrs``: our multiaddrs, which the heartbeat lists so that others (and the dashboard) can name
        us as an entry point."""
        self.store, self.run_id, self.me, self.timing = store, run_id, me, timing
        self.n_experts, self.orphan_grace_s = n_experts, orphan_grace_s
        self.view = MembershipView(holders={e: frozenset() for e in range(n_experts)})
        self._local = list(experts)
        self._hb = Heartbeat(
            experts=list(experts), state="training", period_s=timing.heartbeat_s, addrs=list(addrs or [])[:8]
        )
        self._lock = threading.Lock()  # guards _hb, _claimed, _local, _leaving
        self._claimed: list[int] | None = None
        self._leaving = False
        self._last_step_time: float | None = None
        self._stop = threading.Event()
        self._seen: dict[str, tuple[Heartbeat, float]] = {}  # peer -> (its heartbeat, when last read)
        self._heard: dict[str, tuple[float | None, float]] = {}  # peer -> (its sent_at, when first read)
        self._refresh_lock = threading.Lock()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="swarm-heartbeat", daemon=True)
        self._thread.start()

    # -- reading the swarm ---------------------------------------------------------------------------------
    def refresh(self, timeout: float | None = None) -> None:
        """Reads every heartbeat now, within ``timeout`` (default: the heartbeat period), lock included; the
        view stays as it was if the read fails or another thread's read holds the lock that long."""
        timeout = self.timing.heartbeat_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # the heartbeat thread and the training thread (a first round, leaving) both refresh
        if not self._refresh_lock.acquire(timeout=timeout):
            return
        try:
            self._refresh(max(0.0, deadline - time.monotonic()))
        finally:
            self._refresh_lock.release()

    def _refresh(self, timeout: float) -> None:
        records = read_records(self.store, self.run_id, timeout=timeout)
        if records is None or self.me not in records:  # no answer (or our record is not out yet)
            return
        # a read can miss a live peer's subkey (the DHT node that answered has an older copy), and a loaded
        # peer's heartbeat can come late: a peer seen within two record lifetimes stays in the view unless
        # it withdrew, so that two peers' views (and the averaging groups they derive) do not flicker apart
        now = time.monotonic()
        for peer, (hb, _) in records.items():
            self._seen[peer] = (hb, now)
            # a dead peer's last record stays readable until it expires: only a new one says it lives
            if peer not in self._heard or self._heard[peer][0] != hb.sent_at:
                self._heard[peer] = (hb.sent_at, now)
        self._seen = {
            p: (hb, t) for p, (hb, t) in self._seen.items()
            if hb.state != "leaving" and now - t <= 2 * self.timing.record_ttl_s
        }  # fmt: skip
        self._heard = {p: v for p, v in self._heard.items() if p in self._seen}
        beats = {p: (hb, 0.0) for p, (hb, _) in self._seen.items()}
        holders = expert_holders(beats, self.n_experts)
        before = self.view.orphaned_since
        orphaned = {e: before.get(e, now) for e, who in holders.items() if not who}
        self.view = MembershipView(
            MappingProxyType({p: hb for p, (hb, _) in self._seen.items()}),
            MappingProxyType({e: frozenset(who) for e, who in holders.items()}),
            MappingProxyType(orphaned),
            MappingProxyType({p: t for p, (_, t) in self._heard.items()}),
            now,
        )

    def wait_until_others_done(self, timeout: float) -> None:
        """Until every other live peer says it is done (it may still download from us), at most ``timeout``.
        Judged by the view, not by one read: a read that times out (no records) or misses a subkey would
        otherwise let us leave while a peer is still downloading our final copies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.refresh()
            if all(hb.state == "done" for p, hb in self.view.peers.items() if p != self.me):
                return
            time.sleep(0.5)

    # -- our heartbeat -------------------------------------------------------------------------------------
    def _publish(self) -> None:
        with self._lock:
            hb = replace(self._hb, experts=list(self._hb.experts))
        t = self.timing
        publish_heartbeat(self.store, self.run_id, self.me, hb, ttl_s=t.record_ttl_s, timeout=t.heartbeat_s)

    def report_step(self, step: int, tokens: int, loss: float, step_tokens: int) -> None:
        """The time of our first step is published at once: peers that start just after us tell by it
        whether we round in their first slot (``swarm.net.first_round``). That heartbeat still says step
        0: a step above 0 tells a joiner that the swarm has trained and it must catch up (``peers.main``),
        and published at once it made peers started a second apart catch up from each other."""
        now = time.monotonic()
        if self._hb.first_step_at is None:
            at = self.store.now()
            with self._lock:
                self._hb.first_step_at = at
            self._publish()
        with self._lock:
            hb, last = self._hb, self._last_step_time
            if last is not None and now > last:  # smoothed tokens/s
                rate = step_tokens / (now - last)
                hb.tokens_per_s = rate if hb.tokens_per_s == 0 else 0.9 * hb.tokens_per_s + 0.1 * rate
            hb.step, hb.tokens, hb.loss = step, tokens, loss
            self._last_step_time = now

    def record_round(self, rec: RoundRecord) -> None:
        with self._lock:
            hb = self._hb
            hb.last_round, hb.last_round_time = rec.round, time.time()
            hb.bytes_sent += rec.bytes_sent
            hb.bytes_recv += rec.bytes_recv
            hb.rounds_ok += int(not rec.rejected)
            hb.rounds_failed += int(bool(rec.rejected))

    def set_state(self, state: str) -> None:
        """Publish ``state`` now. From "finishing" on, no orphan is claimed and a pending claim is void."""
        with self._lock:
            if state != "training":
                self._leaving, self._claimed, self._hb.experts = True, None, list(self._local)
            self._hb.state = state
        self._publish()

    # -- claims --------------------------------------------------------------------------------------------
    @property
    def claimed(self) -> list[int] | None:
        return self._claimed

    def set_experts(self, experts: list[int]) -> None:
        """We train ``experts`` now (after an orphan claim): tell the swarm at once."""
        with self._lock:
            came = set(experts) - set(self._local)
            self._local, self._claimed, self._hb.experts = list(experts), None, list(experts)
        view = self.view
        holders = {e: who | {self.me} if e in came else who for e, who in view.holders.items()}
        orphaned = {e: t for e, t in view.orphaned_since.items() if e not in came}
        self.view = replace(
            view, holders=MappingProxyType(holders), orphaned_since=MappingProxyType(orphaned)
        )
        self._publish()

    def _maybe_claim(self) -> None:
        """When an expert has had no live holder for ``orphan_grace_s`` and all our experts have another
        holder, give up our most replicated expert for it. Eligible peers wait their rank
        (``orphan_claim_rank``) in extra heartbeat periods, and the claim is published at once, so the next
        in rank sees it in time; the trainer switches at its next step."""
        with self._lock:
            if self._leaving or self._claimed is not None:
                return
            local = list(self._local)
        view, now = self.view, time.monotonic()
        holders = {e: set(who) for e, who in view.holders.items()}
        ages = {e: now - since for e, since in view.orphaned_since.items()}
        swap = orphan_swap(local, holders, ages, self.orphan_grace_s, self.me)
        if swap is None:
            return
        give, take = swap
        rank = orphan_claim_rank(take, holders, self.me)
        if rank is None or ages[take] < self.orphan_grace_s + 2 * rank * self.timing.heartbeat_s:
            return
        with self._lock:
            self._claimed = sorted(set(local) - {give} | {take})
            self._hb.experts = list(self._claimed)
        self._publish()

    # -- the thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        tick = time.monotonic()
        while not self._stop.is_set():
            self._publish()
            self.refresh()
            self._maybe_claim()
            tick = max(tick + self.timing.heartbeat_s, time.monotonic() - self.timing.heartbeat_s)
            self._stop.wait(max(0.0, tick - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.timing.heartbeat_s)  # no heartbeat may land after the withdrawal
        with self._lock:
            hb = replace(self._hb, experts=list(self._hb.experts))
        withdraw_heartbeat(self.store, self.run_id, self.me, hb, ttl_s=self.timing.record_ttl_s)  # at once
