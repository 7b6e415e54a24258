"""The last round of peers given one stop time (``swarm-peer --stop-at``): in one process, on the in-memory
network, with real models and ``SwarmSync``."""

import time

import pytest
import torch

from swarm.net.expert_tensors import dense_tensors
from swarm.net.local_transport import LocalNetwork
from tests.sync_peers import SYNC, peer, run

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

