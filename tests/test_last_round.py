"""The last round of peers given one stop time (``swarm-peer --stop-at``): in one process, on the in-memory
network, with real models and ``SwarmSync``."""

import dataclasses
import time

import pytest
import torch

from swarm.net.expert_tensors import dense_tensors
from swarm.net.local_transport import LocalNetwork
from swarm.net.timing import Timing
from swarm.train.sync_hook import StepReport
from tests.sync_peers import MODEL, SYNC, finished_rounds, peer, run

pytestmark = pytest.mark.timeout(60)


def test_a_shared_last_round_begins_once_every_peer_is_in_not_at_its_scheduled_time():
    net = LocalNetwork(matchmaking_s=SYNC.matchmaking_s)
    peers = {me: peer(net, me, [i, (i + 2) % 4], seed=i) for i, me in enumerate("abc")}
    at = time.time() + 8.0  # the shared moment, as --stop-at sets it: seconds after the peers' last steps
    for _, sync in peers.values():
        sync.last_round_at = at
    # c stops about a second and a half after a and b: their last round waits for it, and no longer
    c_stops = time.time() + 10 * 0.25
    out = run(peers, steps=10, step_s={"a": 0.1, "b": 0.1, "c": 0.25})
    last = {me: out[me][-1] for me in "abc"}
    for me, rec in last.items():
        assert rec.last and rec.dense_group == 3 and "dense" in rec.applied_groups, (me, rec)
        ended = rec.started_at + rec.sync_seconds
        # it ended soon after c came, long before the scheduled time (which the groups' leaders would
        # have waited for had anyone been missing); looking only from a matchmaking time before it, as an
        # ordinary scheduled round does, would have ended after at - matchmaking_s
        assert c_stops <= ended < at - SYNC.matchmaking_s - 2.0, (me, ended - c_stops, at - ended)
    assert all(rec.final_adopted == [] for rec in last.values()), last  # the round itself averaged them
    ref = dense_tensors(peers["a"][0])  # the mean, fp32 on the in-memory network (applied as a change)
    for me in "bc":
        for got, want in zip(dense_tensors(peers[me][0]), ref, strict=True):
            assert torch.allclose(got, want, atol=1e-6 * max(1.0, want.abs().max().item()), rtol=0), me


def test_an_ordinary_round_near_a_shared_stop_looks_no_longer_than_a_partner_could_come():
    """No peer given the stop time starts an ordinary round after ``Timing.last_ordinary_start``: a round
    started just before it, whose partner reaches its sync point only after it (and skips), looks for that
    partner until a matchmaking time past it, not for its whole window (which kept both peers' last
    round waiting on a real swarm: 7 to 10 s)."""
    sync = dataclasses.replace(SYNC, round_timeout_s=12.0)  # an ordinary round looks 3.3 s
    timing = Timing.from_config(sync)
    net = LocalNetwork(matchmaking_s=5.0)
    # each holds every expert: nothing to download (which waits for b's copies by rules of its own)
    peers = {me: peer(net, me, [0, 1, 2, 3], seed=i, sync=sync) for i, me in enumerate("ab")}
    model, a = peers["a"]
    t0 = time.time()
    a.last_round_at = t0 + 5.0
    cutoff = timing.last_ordinary_start(a.last_round_at)
    assert cutoff - t0 == pytest.approx(1.4) and timing.ordinary_matchmaking_s == pytest.approx(3.3)
    tokens = torch.zeros(MODEL.n_experts, dtype=torch.long)
    try:
        time.sleep(max(0.0, t0 + 0.8 - time.time()))  # b is in a's view, training, but reaches no sync point
        for step in range(1, sync.sync_every + 1):  # a round starts at the last of these steps
            a.after_step(model, StepReport(step, 64 * step, 64, tokens, 1.0, steps_left=100))
        a.wait_for_round()
        ended = time.time()
        (rec,) = a.apply_finished(model)
        assert rec.started and not rec.last and rec.dense_group == 1, rec
        # it gave up a matchmaking time after the cutoff (+0.3 s), not 3.3 s after it began (t0 + 4.1)
        gave_up = ended - cutoff
        assert sync.matchmaking_s - 0.1 <= gave_up < sync.matchmaking_s + 1.0, (gave_up, rec)
    finally:
        for _, s in peers.values():
            s.close()


def test_peers_whose_steps_straddle_the_last_ordinary_start_all_take_that_slots_round_met_early():
    """Whether a wall-clock round is too close to the shared stop is judged by its slot's start, the same on
    every peer, not by when each peer's step comes: in a demo, the one peer whose step came 0.1 s before
    ``last_ordinary_start`` went on with the groups met early while the three others left them, and its
    partial all-reduce took 45 s and its last round. Here that moment falls 0.15 s into a slot, between
    a's step (0.05 s in) and b's (0.3 s in)."""
    sync = dataclasses.replace(SYNC, sync_every_s=2.0, prematch_s=0.5)
    timing = Timing.from_config(sync)
    net = LocalNetwork(matchmaking_s=SYNC.matchmaking_s)
    peers = {me: peer(net, me, [i, i + 2], seed=i, sync=sync) for i, me in enumerate("ab")}
    tokens = torch.zeros(MODEL.n_experts, dtype=torch.long)

    def step(me: str, n: int) -> list:
        model, s = peers[me]
        return s.after_step(model, StepReport(n, 64 * n, 64, tokens, 1.0, steps_left=100)).records

    try:
        slot = (time.time() // 2.0 + 2) * 2.0
        slot += 2.0 if slot - time.time() < 2.5 else 0.0
        for _, s in peers.values():
            s.last_round_at = slot + 0.15 + (slot + 10.0 - timing.last_ordinary_start(slot + 10.0))
        assert timing.last_ordinary_start(peers["a"][1].last_round_at) == pytest.approx(slot + 0.15)
        time.sleep(slot - time.time() - 2.3)
        step("a", 1), step("b", 1)  # two slots before: only seen
        time.sleep(slot - time.time() - 2.0 + 0.05)
        step("a", 2), step("b", 2)  # the first round meets at its slot
        finished_rounds(peers)
        time.sleep(slot - time.time() - 0.3)
        step("a", 3), step("b", 3)  # both meet the next slot's groups
        time.sleep(slot - time.time() + 0.05)
        assert step("a", 4) == []
        time.sleep(slot - time.time() + 0.3)
        assert step("b", 4) == []  # past the moment, but its slot began before it: it goes on, as a does
        for me, rec in finished_rounds(peers).items():
            assert rec.met_early == ["dense"] and rec.clean and rec.dense_group == 2, (me, rec)
    finally:
        for _, s in peers.values():
            s.close()
