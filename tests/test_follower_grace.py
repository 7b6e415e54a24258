"""A follower whose leader begins the group just after the follower's own deadline still joins it (real
averagers and p2pd on 127.0.0.1; the late leader is injected)."""

import asyncio
import time

import pytest
import torch
from hivemind.averaging.matchmaking import Matchmaking

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.follower_grace import keep_accepted_followers
from swarm.net.hivemind_group import HivemindGroup, close_groups

pytestmark = pytest.mark.timeout(120)
MATCHMAKING_S, REQUEST_S = 2.0, 1.0
LATE_S = 0.5  # how late the leader's event loop is when it begins the group (less than REQUEST_S)


@pytest.fixture(scope="module")
def dhts():
    first = start_dht()
    nodes = [first, start_dht(visible_maddrs(first))]
    yield nodes
    for node in reversed(nodes):
        node.shutdown()


def _group(dht, name: str) -> HivemindGroup:
    return HivemindGroup(
        dht, name, [torch.zeros(10)], matchmaking_time=MATCHMAKING_S, request_timeout=REQUEST_S,
        allreduce_timeout=20.0,
    )  # fmt: skip


def test_a_follower_joins_a_group_begun_after_its_own_deadline(dhts, monkeypatch):
    """The leader expires first (so the follower asks it), counts the follower in its group at its
    expiration, and sends the begin message LATE_S later, when the follower's deadline, 0.2 s after the
    leader's expiration, has passed: both average. Before, the follower ended its step with "could not find
    a group" while the leader's all-reduce counted it, waited for its parts and failed."""
    assemble = Matchmaking.leader_assemble_group

    async def late(self):  # the leader's event loop, busy between forming the group and telling it
        group = await assemble(self)
        await asyncio.sleep(LATE_S)
        return group

    with monkeypatch.context() as patch:  # the leader's averager process is forked with the late class
        patch.setattr(Matchmaking, "leader_assemble_group", late)
        leader = _group(dhts[0], "t_grace")
    follower = _group(dhts[1], "t_grace")
    try:
        expires = time.time() + 3.0
        # no size to wait for: the leader begins at its expiration with whoever joined by then
        lead = leader.start([torch.full((10,), 1.0)], {}, matchmaking_s=8.0, scheduled=expires)
        time.sleep(expires - 1.5 - time.time())
        # a window shorter than the matchmaking time: the follower declares its deadline as its expiration
        follow = follower.start([torch.full((10,), 3.0)], {}, matchmaking_s=expires + 0.2 - time.time())
        outcomes = [leader.outcome(lead, timeout=30), follower.outcome(follow, timeout=30)]
    finally:
        close_groups([leader, follower])
    for out in outcomes:
        assert out.ok, out.reason
        assert len(out.members) == 2
        assert torch.equal(out.tensors[0], torch.full((10,), 2.0))


class _Accepting:
    """What the wrapper reads of hivemind's Matchmaking, with a search we control."""

    def __init__(self, accepted: bool, finish_after_s: float | None):
        self.was_accepted_to_group, self.finish_after_s = asyncio.Event(), finish_after_s
        self.assembled_group = asyncio.get_running_loop().create_future()
        self.cancelled = False
        if accepted:
            self.was_accepted_to_group.set()

    async def look_for_group(self, step):
        try:
            if self.finish_after_s is None:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.finish_after_s)
            return "group"
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class _Step:
    def __init__(self, timeout: float):
        self.deadline = time.monotonic() + timeout

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@pytest.mark.parametrize(
    "accepted, finish_after_s, expected, waited",
    [
        (False, None, None, (0.2, 1.2)),  # not accepted: ends at the deadline, not after the grace
        (True, 0.5, "group", (0.5, 1.2)),  # accepted, begun within the grace: the group
        (True, None, None, (1.2, 3.0)),  # accepted, never begun: ends when the grace is over
        (False, 0.1, "group", (0.1, 1.2)),  # a group before the deadline
    ],
)
def test_the_search_ends_at_the_deadline_unless_a_leader_holds_us(accepted, finish_after_s, expected, waited):
    async def run():
        mm = _Accepting(accepted, finish_after_s)
        keep_accepted_followers(mm, grace_s=1.0)
        keep_accepted_followers(mm, grace_s=99.0)  # installed once
        t0 = time.monotonic()
        got = await mm.look_for_group(_Step(0.2))
        return got, time.monotonic() - t0, mm.cancelled

    got, took, cancelled = asyncio.run(run())
    assert got == expected
    assert waited[0] <= took < waited[1]
    assert cancelled == (expected is None)
