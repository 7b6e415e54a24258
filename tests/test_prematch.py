"""Groups met before a round's slot (``sync.prematch_s``, ``swarm.net.prematch``) on hivemind's real averagers
and p2pd; the round and ``SwarmSync`` sides run on the in-memory network (``test_round``, ``test_swarm_sync``)."""

import dataclasses
import time

import pytest
import torch

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.hivemind_group import close_groups
from swarm.net.hivemind_transport import HivemindTransport
from swarm.net.timing import Timing

pytestmark = pytest.mark.timeout(120)
TIMING = Timing(matchmaking_s=3.0, round_s=30.0, download_s=20.0, heartbeat_s=1.0, request_s=1.5,
                final_agreement_s=5.0)  # fmt: skip


def test_a_group_met_before_its_slot_averages_exactly_the_tensors_written_at_the_trigger():
    """``sync.prematch_s`` on hivemind: the members meet seconds ahead, keep serving their last result
    meanwhile, and each writes its tensors only when it triggers the all-reduce. A member that triggers
    later than a sender is waited for (2 x request_s) is still waited for, up to ``Timing.late_s``."""
    timing = dataclasses.replace(TIMING, late_s=3.0)  # a sender is otherwise given up after 3 s
    first = start_dht()
    dhts = [first, start_dht(visible_maddrs(first)), start_dht(visible_maddrs(first))]
    groups = [HivemindTransport(d, timing).open("t_early", [torch.zeros(1000), torch.zeros(1)]) for d in dhts]
    try:
        groups[0].serve([torch.full((1000,), 9.0), torch.ones(1)], {"step": 1})
        slot = time.time() + 2.0
        handles = [g.prematch({"i": i}, slot, TIMING.matchmaking_s, expected=3) for i, g in enumerate(groups)]
        while not all(g.formed(h) for g, h in zip(groups, handles, strict=True)):
            assert time.time() < slot, "the group did not meet before its slot"
            time.sleep(0.02)
        served = HivemindTransport(dhts[1], TIMING).fetch(dhts[0].peer_id.to_base58(), "t_early", timeout=10)
        assert served.meta == {"step": 1} and served.tensors[0][0].item() == 9.0  # still our last result
        time.sleep(max(0.0, slot - time.time()))
        for i, (g, h) in enumerate(zip(groups, handles, strict=True)):
            if i == 2:
                time.sleep(4.0)  # a member held up by a long step or an evaluation
            g.trigger(h, [torch.full((1000,), float(i + 1)), torch.ones(1)])
        outcomes = [g.outcome(h, timeout=20) for g, h in zip(groups, handles, strict=True)]
        for out in outcomes:
            assert out.ok, out.reason
            assert sorted(info["i"] for info in out.members.values()) == [0, 1, 2]
            assert torch.equal(out.tensors[0], torch.full((1000,), 2.0)) and out.tensors[1].item() == 1.0
    finally:
        close_groups(groups)
        for d in reversed(dhts):
            d.shutdown()


def test_a_round_that_stops_looking_before_the_next_slots_meeting_is_not_taken_into_those_groups():
    """Every slot's groups have the same name: a round still looking when the others meet for the next slot
    is taken into their group (its payload in the next slot's average: so it went with a 15 s window here).
    ``Timing.matchmaking_left`` ends its window before then; a window shorter than the averager's
    matchmaking time (3 s here) is also one hivemind takes."""
    first = start_dht()
    dhts = [first, start_dht(visible_maddrs(first)), start_dht(visible_maddrs(first))]
    groups = [HivemindTransport(d, TIMING).open("t_cross", [torch.zeros(100)]) for d in dhts]
    try:
        late = groups[0].start([torch.zeros(100)], {"i": 0}, 1.5, None, expected=3)  # nobody else in it
        time.sleep(2.5)
        slot = time.time() + 2.0
        early = [
            g.prematch({"i": i}, slot, TIMING.matchmaking_s, expected=3) for i, g in enumerate(groups[1:], 1)
        ]
        time.sleep(max(0.0, slot - time.time()))
        for i, (g, h) in enumerate(zip(groups[1:], early, strict=True), 1):
            g.trigger(h, [torch.full((100,), float(i))])
        alone = groups[0].outcome(late, timeout=20)
        assert not alone.ok, alone.members
        for g, h in zip(groups[1:], early, strict=True):
            out = g.outcome(h, timeout=20)
            assert out.ok and sorted(v["i"] for v in out.members.values()) == [1, 2], out.reason
            assert torch.equal(out.tensors[0], torch.full((100,), 1.5))
    finally:
        close_groups(groups)
        for d in reversed(dhts):
            d.shutdown()
