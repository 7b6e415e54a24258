"""When members drop a round, and when a majority applies it (``round_checks``, ``round_consensus``): in
process, on the fault-injecting ``LocalNetwork``."""

import dataclasses
import time

import pytest
import torch

from swarm.config import SyncConfig
from swarm.net.local_transport import Fault
from swarm.net.membership import MembershipView
from swarm.net.round_info import ROBUST_PAIR
from swarm.net.round_payload import Payloads
from tests.local_swarm import TIMING, Swarm

pytestmark = pytest.mark.timeout(60)


def test_a_member_with_another_rule_makes_every_member_drop_the_round():
    peers = {"a": [0, 1], "b": [0, 1]}
    swarm = Swarm(peers)
    mean = dataclasses.replace(swarm.ctx["b"], sync=SyncConfig(aggregation="mean", codec="fp32"))
    swarm.ctx["b"] = mean
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("another rule" in r for r in results[p].record.rejected), results[p].record.rejected


def test_a_member_whose_dense_weights_travel_in_another_codec_makes_every_member_drop_that_group():
    """b runs int8 for everything, a the default (int8, the dense weights in int4): their tolerances and
    errors differ, so both drop the dense group; their expert group (int8 on both) is applied."""
    peers = {"a": [0, 1], "b": [0, 1]}
    swarm = Swarm(peers, sync=SyncConfig(codec="int8", aggregation="mean"))
    other = SyncConfig(codec="int8", dense_codec="int8", aggregation="mean")
    swarm.ctx["b"] = dataclasses.replace(swarm.ctx["b"], sync=other, payloads=Payloads.for_sync(other))
    results = swarm.round({p: swarm.plan(p, refresh=False) for p in peers})
    for p in peers:
        assert results[p].dense is None and sorted(results[p].experts) == [0, 1], results[p].record
        assert [r for r in results[p].record.rejected if "another codec" in r] == [
            "dense: a member's tensors travel in another codec (sync.codec, sync.dense_codec)"
        ], results[p].record.rejected


def test_a_member_that_exchanges_digests_another_way_makes_every_member_drop_the_round():
    """Its digest would never reach the others (nor theirs it): every member says why at once, instead of
    waiting until the round's deadline for a digest that cannot come."""
    peers = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    swarm = Swarm(peers)
    swarm.ctx["c"] = dataclasses.replace(swarm.ctx["c"], sync=SyncConfig(digests="dht", codec="fp32"))
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("sync.digests" in r for r in results[p].record.rejected), results[p].record.rejected


def test_a_silent_member_vetoes_a_group_of_two_but_not_a_majority():
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("silent", peer="b")])  # it never publishes a digest
    results = swarm.round({p: swarm.plan(p) for p in peers})
    want = [torch.stack([swarm.dense[p][0] for p in peers]).mean(0)]
    for p in ("a", "c"):  # the dense group of three: two agree, the third is silent past the grace period
        assert torch.allclose(results[p].dense[1][0], want[0], atol=1e-6)
        assert not any(r.startswith("dense") for r in results[p].record.rejected), results[p].record
    # c is in no other group: its checks ended after the grace period, long before the deadline
    assert results["c"].record.phase_seconds["checks"] < TIMING.round_s / 3, results["c"].record
    # experts 0-1 are averaged by a and b alone: a cannot tell a silent b from a dead one, so drops them
    assert results["a"].experts == {}
    assert any("experts 0,1: partial round: no digest" in r for r in results["a"].record.rejected)


@pytest.mark.parametrize("heartbeat", ["stopped", "round ended", "live"])
def test_a_silent_member_whose_heartbeat_stopped_is_not_awaited_until_the_deadline(heartbeat):
    """A pair whose other member went silent: if its heartbeat stopped too (killed), or says it has ended
    the round it took this group in (the group failed on its side), the round is dropped as soon as the view
    says so; if it still publishes heartbeats of that round (slow), it is awaited until the deadline."""
    peers = {"a": [0, 1], "b": [0, 1]}
    swarm = Swarm(peers, faults=[Fault("silent", peer="b")])
    now = time.monotonic()
    last_heard = now - 10 * TIMING.record_ttl_s if heartbeat == "stopped" else now
    view = dataclasses.replace(swarm.view, heard_at={"a": now, "b": last_heard}, read_at=now)
    if heartbeat == "round ended":  # b's round 1 (the plans' index) is over
        b = dataclasses.replace(view.peers["b"], last_round=1)
        view = dataclasses.replace(view, peers={**view.peers, "b": b})
    swarm.ctx["a"] = dataclasses.replace(swarm.ctx["a"], view_now=lambda: view)
    rec = swarm.round({p: swarm.plan(p) for p in peers})["a"].record
    assert [r.split(":")[0] for r in rec.rejected] == ["dense", "experts 0,1"], rec.rejected
    if heartbeat != "live":
        assert all("without a heartbeat since, or done with that round" in r for r in rec.rejected), (
            rec.rejected
        )
        assert rec.phase_seconds["checks"] < TIMING.round_s / 3, rec.phase_seconds
    else:
        assert rec.phase_seconds["checks"] > TIMING.round_s / 2, rec.phase_seconds
        assert rec.check_seconds["await"] > TIMING.round_s / 2, rec.check_seconds  # the wait is for digests


def test_a_member_whose_result_alone_differs_is_out_voted_by_the_majority():
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("partial", peer="b", round=1)])  # only b's result differs
    results = swarm.round({p: swarm.plan(p) for p in peers})
    want = torch.stack([swarm.dense[p][0] for p in peers]).mean(0)
    for p in ("a", "c"):  # the dense group of three: two agree, and their result is the mean
        assert torch.allclose(results[p].dense[1][0], want, atol=1e-6), p
        assert not any(r.startswith("dense") for r in results[p].record.rejected), results[p].record
    assert results["b"].dense is None and any(
        "dense: partial round" in r for r in results["b"].record.rejected
    )
    # experts 0-1 are averaged by a and b alone: two that differ, and no majority: both drop them
    assert results["a"].experts == {} and results["b"].experts == {}


@pytest.mark.parametrize("kind", ["drop", "nan"])
def test_a_faulty_member_makes_every_member_drop_the_round(kind):
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    # centered clipping would leave a NaN member out and apply the round (test above): the mean cannot
    sync = SyncConfig(aggregation="mean", codec="fp32") if kind == "nan" else None
    swarm = Swarm(peers, faults=[Fault(kind, peer="b", round=1)], sync=sync)
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        rec = results[p].record
        assert results[p].dense is None, (p, rec)
        assert any(r.startswith("dense") for r in rec.rejected), (p, rec.rejected)
    assert results["a"].experts == {} and results["c"].dense is None
    # the next round, without the fault, is clean
    results = swarm.round({p: swarm.plan(p, index=2) for p in peers})
    assert all(results[p].record.rejected == [] and results[p].dense is not None for p in peers)


def test_a_weight_not_claimed_is_rejected():
    peers = {"a": [0], "b": [1]}
    swarm = Swarm(peers, faults=[Fault("scale", peer="b", round=1, factor=30.0)])
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("weights averaged differ" in r for r in results[p].record.rejected), results[p].record


def test_last_rounds_meet_apart_from_ordinary_ones():
    """Peers in their last round average among themselves while the others take an ordinary round: in one
    group, every member would drop it (on H100 peers, a peer whose step limit came a slot after the others'
    met their last round with its ordinary one). An ordinary round does not wait for the finishing peers."""
    peers = {"a": [0], "b": [1], "c": [2], "d": [3], "e": [3], "f": [3]}
    swarm = Swarm(peers, sync=SyncConfig(aggregation="mean", max_rel_distance=4.0, codec="fp32"))
    states = {p: "finishing" if p in "abc" else "training" for p in peers}
    swarm.at_step(10, states)
    t0 = time.monotonic()
    results = swarm.round({p: swarm.plan(p, last=states[p] == "finishing") for p in peers})
    for together in ("abc", "def"):
        want = torch.stack([swarm.dense[p][0] for p in together]).mean(0)
        for p in together:
            assert results[p].record.members["dense"] == list(together), results[p].record
            assert torch.allclose(results[p].dense[1][0], want, atol=1e-6)
            assert results[p].record.rejected == [], results[p].record
    # the ordinary group began as soon as its three were in; the last one waited for the window
    assert results["d"].record.phase_seconds["matchmaking"] < TIMING.matchmaking_s / 2, results["d"].record
    assert time.monotonic() - t0 < TIMING.round_s


def test_a_last_round_waits_its_window_for_finishers_that_come_apart():
    """Peers reach their step limits apart: each finisher's last round begins 0.4 s after the one before,
    longer than the network's matchmaking window (0.3 s), and still all three average together."""
    peers = {"a": [0], "b": [1], "c": [2]}
    swarm = Swarm(peers, sync=SyncConfig(aggregation="mean", max_rel_distance=4.0, codec="fp32"))
    swarm.at_step(10, {p: "finishing" for p in peers})
    results = swarm.round({p: swarm.plan(p, last=True) for p in peers}, apart_s=0.4)
    want = torch.stack([swarm.dense[p][0] for p in peers]).mean(0)
    for p in peers:
        assert results[p].record.members["dense"] == ["a", "b", "c"], results[p].record
        assert torch.allclose(results[p].dense[1][0], want, atol=1e-6)


def test_members_with_different_references_drop_the_round_and_take_the_common_one():
    peers = {"a": [0], "b": [1], "c": [2]}
    swarm = Swarm(peers, sync=SyncConfig(codec="int8"))
    dense = swarm.plan("a").groups[0][0]
    results = swarm.round({p: swarm.plan(p, index=1) for p in peers})
    assert all(results[p].dense for p in peers)
    agreed = swarm.ctx["a"].payloads.reference(dense)
    swarm.ctx["c"].payloads.forget("t_dense")  # as after a restart, or a round c missed
    results = swarm.round({p: swarm.plan(p, index=2) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("different references" in r for r in results[p].record.rejected), results[p].record
    # a and b keep theirs; c takes it from one of them (its served copy), bit for bit
    assert any("took the agreed one from" in r for r in results["c"].record.rejected)
    got = swarm.ctx["c"].payloads.reference(dense)
    theirs = [swarm.ctx[q].payloads.reference(dense)[1]["dense"][0] for q in "ab"]
    assert got[0] == agreed[0] and any(torch.equal(got[1]["dense"][0], t) for t in theirs)
    # so the next round sends changes again, and is clean
    results = swarm.round({p: swarm.plan(p, index=3) for p in peers})
    assert all(results[p].record.rejected == [] and results[p].dense for p in peers), {
        p: results[p].record.rejected for p in peers
    }
    ids = {swarm.ctx[p].payloads.reference_id(dense) for p in peers}
    assert len(ids) == 1 and ids != {agreed[0]} and "" not in ids


def test_an_expert_group_whose_references_came_apart_starts_a_common_one_and_averages_again():
    """Three holders of the same experts; b's round 2 is partial, so a and c move the expert group's
    reference on and b cannot. Expert groups have no served reference to take: round 3 finds the references
    apart and every member forgets its own, round 4 averages weights into a new common reference, and round
    5 sends changes against it. (Had a and c kept theirs, every later round of the group would be dropped.)"""
    peers = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    timing = dataclasses.replace(TIMING, matchmaking_s=2.0)
    swarm = Swarm(
        peers, faults=[Fault("partial", peer="b", round=2)], sync=SyncConfig(codec="int8"), timing=timing
    )
    spec = {p: [g for g, _ in swarm.plan(p).groups if g.items != ("dense",)][0] for p in peers}
    for index in (1, 2, 3, 4, 5):
        results = swarm.round({p: swarm.plan(p, index=index) for p in peers})
        refs = {p: swarm.ctx[p].payloads.reference_id(spec[p]) for p in peers}
        experts = {p: [r for r in results[p].record.rejected if r.startswith("expert")] for p in peers}
        if index == 2:
            assert "partial" in experts["b"][0] and experts["a"] == experts["c"] == [], experts
        elif index == 3:
            assert all("different references" in experts[p][0] for p in peers), experts
            assert all(not results[p].experts for p in peers)
            assert set(refs.values()) == {""}, refs  # every member forgot its reference
        else:
            assert all(e == [] for e in experts.values()), experts
            assert all(sorted(results[p].experts) == [0, 1] for p in peers)
            assert refs["a"] and refs["a"] == refs["b"] == refs["c"], refs


def test_a_split_round_keeps_the_reference_so_the_next_round_with_everyone_is_applied():
    """Rounds on steps, peers out of phase: four int8 peers' group splits into two pairs. Had each pair moved
    its reference on to its own result, the next round with all four would be dropped (references differ);
    each keeps the one all four agreed, so that round is applied, with the mean of the four."""
    peers = {"a": [0], "b": [1], "c": [2], "d": [3]}
    swarm = Swarm(peers, sync=SyncConfig(aggregation="mean", codec="int8", max_rel_distance=4.0))
    spec = swarm.plan("a").groups[0][0]

    def refs():
        return {p: swarm.ctx[p].payloads.reference_id(spec) for p in peers}

    def round_of(together, index):
        results = swarm.round({p: swarm.plan(p, index=index, refresh=False) for p in together})
        for p in together:
            assert results[p].record.members["dense"] == sorted(together), results[p].record
            assert results[p].record.rejected == [], results[p].record
        return results

    round_of("abcd", 1)
    agreed = refs()
    assert len(set(agreed.values())) == 1 and "" not in agreed.values()
    for p in peers:  # training moves every peer's weights on
        swarm.dense[p] = [
            swarm.dense[p][0] + 0.1 * torch.randn(6, 5, generator=torch.Generator().manual_seed(7))
        ]
    for pair in ("ab", "cd"):
        results = round_of(pair, 2)
        want = torch.stack([swarm.dense[p][0] for p in pair]).mean(0)
        for p in pair:
            assert torch.allclose(results[p].dense[1][0], want, atol=0.02)
    assert refs() == agreed and all(swarm.ctx[p].payloads.held(spec) == 1 for p in peers)

    results = round_of("abcd", 3)
    want = torch.stack([swarm.dense[p][0] for p in peers]).mean(0)
    for p in peers:
        assert torch.allclose(results[p].dense[1][0], want, atol=0.02)
    moved = refs()
    assert len(set(moved.values())) == 1 and moved != agreed
    assert all(swarm.ctx[p].payloads.held(spec) == 0 for p in peers)


@pytest.mark.parametrize("failed", [("c", "d"), ("d",)])
def test_members_whose_side_of_the_all_reduce_failed_say_so_and_nobody_waits_for_their_digests(failed):
    """c and d (or d alone) fail their side of the dense all-reduce once the group formed (a sender they
    waited for timed out), knowing the group, and send a digest that agrees with nothing. Two of four left:
    no majority, everyone drops the round at once; one of four: the other three apply it at once. Before,
    the others waited for the failed members' digests until their deadline (or the grace period)."""
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3], "d": [2, 3]}
    timing = dataclasses.replace(TIMING, round_s=20.0)  # a grace period of 2 s, a deadline 20 s away
    swarm = Swarm(peers, faults=[Fault("failed", peer=p, round=1) for p in failed], timing=timing)
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in set(peers) - set(failed):
        rec = results[p].record
        dense = [r for r in rec.rejected if r.startswith("dense")]
        if len(failed) == 2:
            assert results[p].dense is None and len(dense) == 1, (p, rec.rejected)
            assert "(2 failed on their side)" in dense[0], dense
        else:  # the three whole results agree: a majority, applied without waiting out the grace period
            assert results[p].dense is not None and dense == [], (p, rec.rejected)
        assert rec.check_seconds["await"] < timing.quorum_grace_s / 3, (p, rec.check_seconds)
    for p in failed:
        assert any("dense: partial all-reduce" in r for r in results[p].record.rejected), results[p].record


@pytest.mark.parametrize("b_sees_c", [True, False])
def test_a_dense_pair_is_dropped_by_both_members_when_either_sees_a_third_peer(b_sees_c):
    """Under the robust rule two members cannot out-vote a rogue, so a dense pair is dropped while three or
    more peers are in view. Both judge by both views: in a demo's first round, a pair's members saw four
    peers and two, and one dropped the round while the other applied it. a sees c here (which takes no part
    in the round); b sees c or not. With nobody seeing a third peer, the pair is applied."""
    peers = {"a": [0, 1], "b": [2, 3], "c": []}
    swarm = Swarm(peers)
    two = MembershipView({p: hb for p, hb in swarm.view.peers.items() if p != "c"}, swarm.view.holders, {})
    for a_sees_c in (True, False):
        views = {"a": swarm.view if a_sees_c else two, "b": swarm.view if b_sees_c else two}
        results = swarm.round({p: swarm.plan(p) for p in "ab"}, views=views)
        for p in "ab":
            rec = results[p].record
            assert rec.dense_group == 2, rec
            if a_sees_c or b_sees_c:
                assert results[p].dense is None and rec.rejected == [f"dense: {ROBUST_PAIR}"], (p, rec)
            else:
                assert results[p].dense is not None and rec.rejected == [], (p, rec)
