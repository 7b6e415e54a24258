"""``group_layout``: which peers a group's round waits for, and which its reference waits for."""

from swarm.net.group_layout import (
    DENSE,
    GroupSpec,
    core_spec,
    dense_group_names,
    dense_spec,
    expected_members,
    is_dense,
    layout,
    reference_quorum,
)
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


def test_a_core_round_puts_the_core_group_where_the_dense_one_was_and_expects_the_same_peers():
    holders = {0: frozenset({"a", "b"}), 1: frozenset({"a"})}
    full, sole = layout("t", "a", [0, 1], holders)
    core, same_sole = layout("t", "a", [0, 1], holders, full=False)
    assert full[0] == dense_spec("t") and core[0] == core_spec("t") and full[1:] == core[1:]
    assert sole == same_sole == [1]
    # the transports give both the dense codec (a name ending as the dense group's)
    assert core_spec("t").name.endswith(dense_spec("t").name[1:]) and is_dense(core_spec("t"))
    assert dense_group_names("t") == {"t_dense", "t_core_dense"} and not is_dense(full[1])
    beats = {
        p: Heartbeat(experts=[0], step=10, state=s) for p, s in {"a": "training", "b": "joining"}.items()
    }
    view = MembershipView(beats, holders, {})
    for check in (expected_members, reference_quorum):
        assert check(core_spec("t"), view, "a") == check(dense_spec("t"), view, "a")
