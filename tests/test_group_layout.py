"""``group_layout``: which peers a group's round waits for, and which its reference waits for."""

from swarm.net.group_layout import DENSE, GroupSpec, expected_members, reference_quorum
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat

DENSE_SPEC = GroupSpec("t_dense", (DENSE,))
EXPERTS_SPEC = GroupSpec("t_experts_0", ("expert0",))


def test_a_round_expects_peers_that_train_and_its_reference_also_waits_for_joiners():
    states = {"a": "training", "b": "training", "c": "joining", "d": "finishing", "e": "done"}
    beats = {p: Heartbeat(experts=[0], step=10, state=s) for p, s in states.items()}
    view = MembershipView(beats, {0: frozenset({"a", "c"})}, {})
    assert expected_members(DENSE_SPEC, view, "a") == 2  # a and b: a joiner has not caught up yet
    assert expected_members(DENSE_SPEC, view, "a", last=True) == 3  # a last round meets finishers
    assert reference_quorum(DENSE_SPEC, view, "a") == 3  # the joiner will be at a round soon
    assert expected_members(EXPERTS_SPEC, view, "a") == reference_quorum(EXPERTS_SPEC, view, "a") == 2
