"""A follower whose leader begins the group just after the follower's own deadline still joins it (real
averagers and p2pd on 127.0.0.1; the late leader is injected)."""

import asyncio
import time

import pytest
import torch
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils.timed_storage import get_dht_time

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


def _group(dht, name: str, request_s: float = REQUEST_S) -> HivemindGroup:
    return HivemindGroup(
        dht, name, [torch.zeros(10)], matchmaking_time=MATCHMAKING_S, request_timeout=request_s,
        allreduce_timeout=20.0,
    )  # fmt: skip


def _average_with_a_late_leader(leader: HivemindGroup, follower: HivemindGroup, follower_lead_s: float):
    """The leader expires 3 s from now; the follower starts ``follower_lead_s`` before that, with a window
    that ends 0.2 s after it. Returns both outcomes."""
    try:
        expires = time.time() + 3.0
        # no size to wait for: the leader begins at its expiration with whoever joined by then
        lead = leader.start([torch.full((10,), 1.0)], {}, matchmaking_s=8.0, scheduled=expires)
        time.sleep(expires - follower_lead_s - time.time())
        # a window shorter than the matchmaking time: the follower declares its deadline as its expiration
        follow = follower.start([torch.full((10,), 3.0)], {}, matchmaking_s=expires + 0.2 - time.time())
        return [leader.outcome(lead, timeout=30), follower.outcome(follow, timeout=30)]
    finally:
        close_groups([leader, follower])


def _assert_both_averaged(outcomes) -> None:
    for out in outcomes:
        assert out.ok, out.reason
        assert len(out.members) == 2
        assert torch.equal(out.tensors[0], torch.full((10,), 2.0))


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
    _assert_both_averaged(_average_with_a_late_leader(leader, follower, follower_lead_s=1.5))


def test_a_follower_whose_acceptance_arrives_after_its_deadline_joins(dhts, monkeypatch):
    """The follower asks the leader in time, but the leader's ACCEPTED reaches it only after the follower's
    deadline (a busy leader), when the leader has already counted it: both average. Before, the follower
    was still awaiting the reply at its deadline, so nothing held it (the grace covered only a follower
    already accepted), and it left a group that counted it (seen once in a full suite on 2 cores)."""
    join = Matchmaking.rpc_join_group

    async def held_acceptance(self, request, context):  # the leader goes on; its replies arrive late
        replies: asyncio.Queue = asyncio.Queue()

        async def answer():
            async for reply in join(self, request, context):
                await replies.put(reply)
            await replies.put(None)

        answering = asyncio.create_task(answer())
        try:
            first = await replies.get()  # ACCEPTED: the follower is already among the leader's followers
            expires = self.potential_leaders.declared_expiration_time
            await asyncio.sleep(max(0.0, expires + 0.45 - get_dht_time()))  # past the follower's deadline
            while first is not None:
                yield first
                first = await replies.get()
        finally:
            answering.cancel()

    with monkeypatch.context() as patch:
        patch.setattr(Matchmaking, "rpc_join_group", held_acceptance)
        leader = _group(dhts[0], "t_grace_reply", request_s=1.5)
    follower = _group(dhts[1], "t_grace_reply", request_s=1.5)
    _assert_both_averaged(_average_with_a_late_leader(leader, follower, follower_lead_s=0.8))


class _Accepting:
    """What the wrapper reads of hivemind's Matchmaking, with a search we control. ``state``: "accepted"
    (a leader holds us), "asking" (our join request awaits its reply) or "free"."""

    def __init__(self, state: str, finish_after_s: float | None):
        self.was_accepted_to_group, self.finish_after_s = asyncio.Event(), finish_after_s
        self.lock_request_join_group, self.state = asyncio.Lock(), state
        self.assembled_group = asyncio.get_running_loop().create_future()
        self.cancelled = False
        if state == "accepted":
            self.was_accepted_to_group.set()

    async def look_for_group(self, step):
        try:
            if self.state == "asking":
                await self.lock_request_join_group.acquire()  # released when the search ends
            if self.finish_after_s is None:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.finish_after_s)
            return "group"
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            if self.lock_request_join_group.locked():
                self.lock_request_join_group.release()


class _Step:
    def __init__(self, timeout: float):
        self.deadline = time.monotonic() + timeout

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@pytest.mark.parametrize(
    "state, finish_after_s, expected, waited",
    [
        ("free", None, None, (0.2, 1.2)),  # not accepted: ends at the deadline, not after the grace
        ("accepted", 0.5, "group", (0.5, 1.2)),  # accepted, begun within the grace: the group
        ("accepted", None, None, (1.2, 3.0)),  # accepted, never begun: ends when the grace is over
        ("asking", 0.5, "group", (0.5, 1.2)),  # a reply awaited at the deadline, then begun: the group
        ("asking", None, None, (1.2, 3.0)),  # a reply that never comes: ends when the grace is over
        ("free", 0.1, "group", (0.1, 1.2)),  # a group before the deadline
    ],
)
def test_the_search_ends_at_the_deadline_unless_a_leader_holds_us(state, finish_after_s, expected, waited):
    async def run():
        mm = _Accepting(state, finish_after_s)
        keep_accepted_followers(mm, grace_s=1.0)
        keep_accepted_followers(mm, grace_s=99.0)  # installed once
        t0 = time.monotonic()
        got = await mm.look_for_group(_Step(0.2))
        return got, time.monotonic() - t0, mm.cancelled

    got, took, cancelled = asyncio.run(run())
    assert got == expected
    assert waited[0] <= took < waited[1]
    assert cancelled == (expected is None)
