"""``Timing``: the bounds of the swarm layer's waits, derived from the sync config."""

import pytest

from swarm.config import SyncConfig
from swarm.net.timing import MIN_LOOK_S, Timing

# slots of 10 s, groups met 2 s before each, an ordinary round may look for 5 + 60 / 4 = 20 s
WALL = Timing.from_config(
    SyncConfig(sync_every_s=10, matchmaking_s=5.0, round_timeout_s=60.0, prematch_s=2.0)
)


def test_rounds_on_steps_look_for_members_for_the_whole_ordinary_window():
    on_steps = Timing.from_config(SyncConfig(matchmaking_s=5.0, round_timeout_s=60.0))
    assert on_steps.matchmaking_left(None, 1234.5) == on_steps.ordinary_matchmaking_s == 20.0
    assert WALL.matchmaking_left(None, 1234.5) == 20.0  # a last round: its own scheduled window


@pytest.mark.parametrize(
    ("into_slot", "left"),
    [
        (0.0, 7.0),  # at its start: until 1 s (the clocks' margin) before the next slot's meeting at 8 s
        (2.6, 4.4),  # a round begun late in its slot stops looking before the others meet for the next
        (6.95, MIN_LOOK_S),  # too late to meet anyone: fails at once
        (9.5, MIN_LOOK_S),
    ],
)
def test_a_wall_clock_round_stops_looking_before_the_next_slots_groups_meet(into_slot, left):
    slot = 172_000_000
    assert WALL.matchmaking_left(slot, slot * 10.0 + into_slot) == pytest.approx(left)


def test_a_group_met_early_is_bounded_by_its_own_slot_and_a_long_slot_by_the_ordinary_window():
    slot = 172_000_000
    # met 2 s before slot's start, counted from that start (what ``Group.prematch`` adds to its wait)
    assert WALL.matchmaking_left(slot, slot * 10.0) == pytest.approx(7.0)
    long_slots = Timing.from_config(SyncConfig(sync_every_s=120, matchmaking_s=5.0, round_timeout_s=60.0))
    assert long_slots.matchmaking_left(slot, slot * 120.0 + 3.0) == 20.0
    # short slots: the margin for the clocks shrinks with them (a tenth of a slot)
    short = Timing.from_config(
        SyncConfig(sync_every_s=2, matchmaking_s=0.3, round_timeout_s=4.0, prematch_s=0)
    )
    assert short.matchmaking_left(slot, slot * 2.0) == pytest.approx(1.3)
    assert short.matchmaking_left(slot, slot * 2.0 + 1.0) == pytest.approx(0.8)
