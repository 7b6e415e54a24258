"""Round digests as members compare them: another member's digest may be anything."""

import math

import pytest

from swarm.net.round_consensus import digests_agree, group_key


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None, True])
def test_a_digest_with_a_value_that_is_not_a_finite_number_agrees_with_nothing(bad):
    mine = [4.0, 1.0, 2.0, -0.5]
    assert digests_agree(mine, list(mine))
    assert not digests_agree(mine, [bad, 1.0, 2.0, -0.5]) and not digests_agree(mine, [4.0, 1.0, 2.0, bad])


def test_the_group_key_is_the_same_for_every_member_whatever_the_members_sent():
    a = {"peer-a": {"step": 1, 2: "a key that is not text"}, "peer-b": {"step": 2, "ref": None}}
    b = {"peer-b": {"ref": None, "step": 2}, "peer-a": {2: "a key that is not text", "step": 1}}
    assert group_key("r", "g", a) == group_key("r", "g", b) != group_key("r", "g", {"peer-a": {"step": 1}})
