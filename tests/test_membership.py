"""Membership on the in-memory store: views, orphan claims, withdrawal (seconds)."""

import threading
import time

import pytest

from swarm.config import SyncConfig
from swarm.net.local_transport import LocalNetwork
from swarm.net.membership import Membership
from swarm.net.timing import Timing

pytestmark = pytest.mark.timeout(120)
TIMING = Timing.from_config(SyncConfig(heartbeat_s=0.5, matchmaking_s=2.0, round_timeout_s=10.0))


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def stores():
    net = LocalNetwork()
    return [(net.store(me), me) for me in ("peer-a", "peer-b")]


def test_views_show_every_holder_and_exactly_one_peer_takes_an_orphan(stores):
    # experts 0 and 1 are held by both peers (replicated), expert 2 by nobody: one of them must take it
    members = [Membership(store, me, "m1", TIMING, [0, 1], 3, orphan_grace_s=1.0) for store, me in stores]
    try:
        ids = {m.me for m in members}
        assert _wait(lambda: all(set(m.view.peers) == ids for m in members), 10), "peers never saw each other"
        view = members[0].view
        assert view.holders[0] == frozenset(ids) and view.holders[2] == frozenset()
        with pytest.raises(TypeError):
            view.holders[2] = frozenset(ids)  # a view is never edited, only replaced
        assert _wait(lambda: any(m.claimed for m in members), 15), "nobody took the orphan"
        time.sleep(6 * TIMING.heartbeat_s)  # the other peer's turn comes and goes
        claims = [m.claimed for m in members]
        assert sum(c is not None for c in claims) == 1, claims
        taker = next(m for m in members if m.claimed)
        assert 2 in taker.claimed and len(taker.claimed) == 2
        taker.set_experts(taker.claimed)
        assert taker.claimed is None and taker.me in taker.view.holders[2]
        other = next(m for m in members if m is not taker)
        assert _wait(lambda: taker.me in other.view.holders[2], 5)
        assert other.claimed is None
    finally:
        for m in members:
            m.close()


def test_a_closed_member_is_gone_at_once_and_finishing_peers_claim_nothing(stores):
    a = Membership(*stores[0], "m2", TIMING, [0], 2, orphan_grace_s=0.5)
    b = Membership(*stores[1], "m2", TIMING, [0], 2, orphan_grace_s=0.5)
    try:
        a.set_state("finishing")
        b.set_state("finishing")
        assert _wait(lambda: a.me in b.view.peers and b.view.peers[a.me].state == "finishing", 10)
        time.sleep(5 * TIMING.heartbeat_s)
        assert a.claimed is None and b.claimed is None  # expert 1 is an orphan, but both are leaving
        a.close()
        b.refresh()
        assert a.me not in b.view.peers  # the withdrawal takes effect before the record would expire
    finally:
        b.close()


class _Crashable:
    """A peer's store that stops writing when the peer is 'killed' (its records are neither renewed nor
    withdrawn, as after kill -9); reads go on."""

    def __init__(self, store):
        self.store, self.killed = store, False

    def put(self, *args, **kwargs):
        return False if self.killed else self.store.put(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.store, name)


class _Blind:
    """A peer's store whose reads fail (no answer in time) while ``blind``, or miss every other peer's record
    while ``partial`` (the DHT node that answered has an older copy); writes go on."""

    def __init__(self, store):
        self.store, self.blind, self.partial = store, False, False

    def get_subkeys(self, key, timeout=10.0):
        if self.blind:
            return None
        found = self.store.get_subkeys(key, timeout)
        return {k: v for k, v in found.items() if k == self.store.me} if self.partial and found else found

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_done_peer_waits_for_the_others_through_failed_and_partial_reads(stores):
    """A holder keeps serving until the others are done: a read that fails or misses a finishing peer's
    record is no news that it is done (it would leave while that peer still downloads from it)."""
    (store_a, me_a), (store_b, me_b) = stores
    a_store = _Blind(store_a)
    a = Membership(a_store, me_a, "m4", TIMING, [0], 2, orphan_grace_s=60.0)
    b = Membership(store_b, me_b, "m4", TIMING, [1], 2, orphan_grace_s=60.0)
    try:
        b.set_state("finishing")
        assert _wait(lambda: me_b in a.view.peers and a.view.peers[me_b].state == "finishing", 10)
        a.set_state("done")
        for fault in ("blind", "partial"):
            setattr(a_store, fault, True)
            started = time.monotonic()
            a.wait_until_others_done(2 * TIMING.heartbeat_s)
            assert time.monotonic() - started >= 2 * TIMING.heartbeat_s, fault  # waited its whole bound
            setattr(a_store, fault, False)
        threading.Timer(2 * TIMING.heartbeat_s, b.set_state, ("done",)).start()
        started = time.monotonic()
        a.wait_until_others_done(10.0)
        waited = time.monotonic() - started
        assert 2 * TIMING.heartbeat_s <= waited < 5.0, waited  # until b said it is done, not the bound
    finally:
        a.close()
        b.close()


def test_a_peer_that_stopped_publishing_is_silent_and_a_live_one_is_not(stores):
    (store_a, me_a), (store_b, me_b) = stores
    b_store = _Crashable(store_b)
    a = Membership(store_a, me_a, "m3", TIMING, [0], 2, orphan_grace_s=60.0)
    b = Membership(b_store, me_b, "m3", TIMING, [1], 2, orphan_grace_s=60.0)
    try:
        assert _wait(lambda: me_b in a.view.peers, 10)
        time.sleep(4 * TIMING.heartbeat_s)
        assert a.view.silent_for(me_b) <= 2.5 * TIMING.heartbeat_s, a.view.heard_at
        assert a.view.silent_for("never-seen") == 0.0
        b_store.killed = True
        # its last record stays readable until it expires: only the absence of new ones says it died
        assert _wait(lambda: a.view.silent_for(me_b) > TIMING.record_ttl_s, 10 * TIMING.heartbeat_s)
        assert me_b in a.view.peers  # still in the view (it may be a late reader's miss), but silent
        assert b.view.silent_for(me_a) <= 2.5 * TIMING.heartbeat_s, b.view.heard_at  # b still hears a
    finally:
        a.close()
        b.close()


class _Slow:
    """A peer's store whose reads take ``seconds`` while set (past a read's timeout: no answer)."""

    def __init__(self, store):
        self.store, self.seconds = store, 0.0

    def get_subkeys(self, key, timeout=10.0):
        time.sleep(min(self.seconds, timeout))
        return None if self.seconds > timeout else self.store.get_subkeys(key, timeout)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_refresh_with_a_timeout_returns_within_it_while_reads_are_slow_and_otherwise_reads_anew(stores):
    """The training thread reads the swarm before its first round (``SwarmSync.start_round``): a slow DHT,
    or the heartbeat thread's read under way, holds it up for the timeout at most."""
    (store_a, me_a), (store_b, me_b) = stores
    slow = _Slow(store_a)
    a = Membership(slow, me_a, "m5", Timing.from_config(SyncConfig(heartbeat_s=30.0)), [0], 2, 60.0)
    b = None
    try:
        assert _wait(lambda: me_a in a.view.peers, 10)  # the heartbeat thread's first read; the next in 30 s
        b = Membership(store_b, me_b, "m5", TIMING, [1], 2, orphan_grace_s=60.0)
        slow.seconds = 3.0
        threading.Thread(target=a.refresh, daemon=True).start()  # a read under way: it holds the lock 3 s
        time.sleep(0.2)
        started = time.monotonic()
        a.refresh(timeout=0.4)  # waits for the lock
        assert time.monotonic() - started < 0.8 and me_b not in a.view.peers
        assert _wait(lambda: me_b in a.view.peers, 5)  # the read under way ends, and sees b
        read_at, started = a.view.read_at, time.monotonic()
        a.refresh(timeout=0.4)  # its own read does not answer in time: the view stays
        assert time.monotonic() - started < 0.8 and a.view.read_at == read_at
        slow.seconds = 0.0
        a.refresh(timeout=0.4)
        assert a.view.read_at > read_at
    finally:
        a.close()
        if b is not None:
            b.close()
