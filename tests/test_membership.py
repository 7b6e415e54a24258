"""Membership on the in-memory store: views, orphan claims, withdrawal (seconds)."""

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
