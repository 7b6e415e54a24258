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


def test_a_dissent_with_a_member_missing_fails_after_the_grace_period_not_the_deadline():
    """A member dropped out mid-round: the two left differ (its share is untouched in both) and its digest
    never comes. No majority can form unless it sides with us: give it the grace period, not the round."""
    import time

    from swarm.net.local_transport import LocalNetwork
    from swarm.net.round_consensus import await_digests, publish_digest

    net = LocalNetwork()
    mine, theirs = [1.0, 2.0, 3.0, 4.0], [1.0, 2.5, 3.0, 4.0]
    assert publish_digest(net.store("b"), "k", "b", theirs, 1.0)
    t0 = time.monotonic()
    ok, why = await_digests(net.store("a"), "k", "a", ["a", "b", "c"], mine, timeout=20.0, grace=0.5)
    assert not ok and "differs from" in why and time.monotonic() - t0 < 3.0
    # the same with c agreeing with us: a majority of two applies
    assert publish_digest(net.store("c"), "k", "c", mine, 1.0)
    ok, why = await_digests(net.store("a"), "k", "a", ["a", "b", "c"], mine, timeout=20.0, grace=0.5)
    assert ok and "1 differ" in why
