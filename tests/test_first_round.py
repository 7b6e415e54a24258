"""``first_round``: in which slot a peer's first round on the wall clock falls, and whether it meets early:
the rule on views, then peers of ``SwarmSync`` on the in-memory network (``sync_peers``)."""

import dataclasses
import threading
import time

import pytest

from swarm.net.first_round import first_step_joins, partners_rounded
from swarm.net.local_transport import LocalNetwork
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat
from tests.sync_peers import SYNC, peer, run, train

pytestmark = pytest.mark.timeout(90)
BEGAN = 1_800_000_000.0  # the slot our first step falls in began then


def _view(**others: Heartbeat) -> MembershipView:
    return MembershipView({"me": _beat(experts=[0]), **others})


def _beat(**fields) -> Heartbeat:
    return Heartbeat(**({"state": "training"} | fields))


@pytest.mark.parametrize(
    ("other", "joins"),
    [
        (_beat(experts=[1], first_step_at=BEGAN - 0.4), True),  # stepped before the slot: rounds in it
        (_beat(experts=[1], first_step_at=BEGAN + 0.1), False),  # started in it too: its first slot is seen
        (_beat(experts=[1]), False),  # has not stepped (or an older peer that does not say)
        (_beat(experts=[1], first_step_at=BEGAN - 60, state="joining"), False),  # not a partner yet
    ],
)
def test_a_first_step_joins_its_slots_round_only_when_a_partner_stepped_before_the_slot(other, joins):
    assert first_step_joins(_view(other=other), "me", BEGAN, prematch=True) is joins
    assert not partners_rounded(_view(other=other), "me")


def test_a_swarm_that_has_rounded_meets_before_the_slot_so_a_first_step_in_it_waits_for_the_next():
    rounded = _beat(experts=[1], first_step_at=BEGAN - 300, last_round=12)
    assert partners_rounded(_view(other=rounded), "me")  # a joiner's first round meets early, as theirs do
    assert not first_step_joins(_view(other=rounded), "me", BEGAN, prematch=True)  # formed at the slot
    assert first_step_joins(_view(other=rounded), "me", BEGAN, prematch=False)  # met at it: still looking
    assert not partners_rounded(_view(me=_beat(experts=[0], last_round=3)), "me")  # ours does not count


@pytest.mark.parametrize(
    ("a_at", "b_at", "first_slot", "steps"),
    [
        # a stepped before the slot began, so it rounds in it: b's first step, early in it, joins that round
        (-0.5, 0.2, 0, 12),
        # nobody stepped before the slot: a's first step in it would make a round alone (and it would look
        # for members into the next slot's meeting); both first round at the next slot
        (0.1, 0.3, 1, 28),
    ],
)
def test_a_first_step_early_in_a_slot_joins_its_round_when_a_partner_stepped_before_it_began(
    a_at, b_at, first_slot, steps
):
    """Peers that start together a second apart round a slot apart otherwise (on H100 peers, the one that
    missed the others' first round then had another int8 reference, and all lost their next dense round).
    Groups meet before later slots (``prematch_s``), not before a peer's first round."""
    sync = dataclasses.replace(SYNC, sync_every_s=2.0, matchmaking_s=1.6, prematch_s=0.5)
    net = LocalNetwork(matchmaking_s=1.6)
    peers = {me: peer(net, me, [i, i + 2], seed=i, sync=sync) for i, me in enumerate("ab")}
    slot = (time.time() // 2.0 + 1) * 2.0
    slot += 2.0 if slot - time.time() < 1.0 else 0.0
    out = run(peers, steps, {"a": 0.1, "b": 0.1}, {"a": slot + a_at, "b": slot + b_at})
    for me in "ab":
        first = next(rec for rec in out[me] if rec.started)
        assert first.clean and first.dense_group == 2, (me, out[me])
        assert int(first.started_at // 2.0) == int(slot // 2.0) + first_slot, (me, first.started_at - slot)


def test_a_joiner_meets_its_first_rounds_groups_before_the_slot_as_a_swarm_that_has_rounded_does():
    """Groups met before the slot form at it with whoever met them: a joiner whose first round met at the
    slot would find the others' groups formed. A swarm's first round meets at its slot (the test above)."""
    sync = dataclasses.replace(SYNC, sync_every_s=2.0, prematch_s=0.5)
    net = LocalNetwork(matchmaking_s=SYNC.matchmaking_s)
    peers = {"a": peer(net, "a", [0, 2], seed=0, sync=sync)}
    slot = (time.time() // 2.0 + 2) * 2.0  # a rounds alone at slot - 2, then meets b for this slot's round
    out = {}
    a = threading.Thread(target=train, args=(*peers["a"], 50, 0, out, "a", 0.1))
    time.sleep(max(0.0, slot - 3.9 - time.time()))
    a.start()
    time.sleep(max(0.0, slot - 0.8 - time.time()))
    peers["b"] = peer(net, "b", [1, 3], seed=1, sync=sync)  # joins: a sees it from its first heartbeat
    time.sleep(max(0.0, slot - 0.3 - time.time()))
    train(*peers["b"], 15, 1, out, "b", 0.1)
    a.join(timeout=60)
    for _, s in peers.values():
        s.close()
    first = next(rec for rec in out["b"] if rec.started)
    assert int(first.started_at // 2.0) == int(slot // 2.0), first.started_at - slot
    assert first.met_early == ["dense"] and first.clean and first.dense_group == 2, out["b"]


def test_a_swarms_first_round_reads_the_swarm_anew_so_peers_that_started_since_the_last_heartbeat_count():
    """A view is read once a heartbeat period (5 s by default). In a demo, peers started seconds apart
    reached the first slot with views of one, two and four peers: one rounded alone, two as a pair that one
    of them dropped (the robust rule, with three in its view) and the other applied. Here views are read
    every 10 s, and the peers are made within a second of their first round."""
    sync = dataclasses.replace(SYNC, sync_every_s=2.0, matchmaking_s=1.0, heartbeat_s=10.0)
    net = LocalNetwork(matchmaking_s=1.0)
    slot = (time.time() // 2.0 + 2) * 2.0
    slot += 2.0 if slot - time.time() < 3.0 else 0.0
    time.sleep(max(0.0, slot - 2.5 - time.time()))
    peers = {}
    for i, me in enumerate(
        "abc"
    ):  # each made once the one before has read the swarm (its next read: in 10 s)
        peers[me] = peer(net, me, [i], seed=i, sync=sync)
        deadline = time.monotonic() + 5.0
        while me not in peers[me][1].members.view.peers and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [sorted(peers[me][1].members.view.peers) for me in "abc"] == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert time.time() < slot - 0.5, slot - time.time()
    out = run(peers, 15, {me: 0.1 for me in peers}, {me: slot - 0.4 for me in peers})
    for me in peers:
        first = next(rec for rec in out[me] if rec.started)
        assert int(first.started_at // 2.0) == int(slot // 2.0), (me, first.started_at - slot)
        assert first.clean and first.dense_group == 3, (me, out[me])
