"""``first_round``: in which slot a peer's first round on the wall clock falls, and whether it meets early."""

import pytest

from swarm.net.first_round import first_step_joins, partners_rounded
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat

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
