"""``HivemindStore``: signed records in hivemind's DHT, with real DHT nodes and p2pds on 127.0.0.1."""

import time

import pytest

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.hivemind_transport import CRAWL_BEAM, HivemindStore
from swarm.net.records import Heartbeat, publish_heartbeat, read_heartbeats, withdraw_heartbeat

pytestmark = pytest.mark.timeout(180)


def test_heartbeats_are_signed_nobody_writes_another_peers_and_malformed_ones_are_ignored():
    honest = start_dht()
    forger = start_dht(visible_maddrs(honest))  # a member with its own key, attacking with plain hivemind
    try:
        store = HivemindStore(honest)
        me = store.me
        hb = Heartbeat(experts=[1, 2], step=5, loss=float("nan"), state="training")
        assert publish_heartbeat(honest, "t_run", me, hb, ttl_s=30)
        fake = Heartbeat(experts=[0, 1, 2, 3], step=10**9, loss=0.001, state="training").to_value()
        later = time.time() + 40  # would replace the honest record, were it accepted
        # the honest peer's own subkey (its owner tag), signed by another key: refused by the DHT
        assert not forger.store("t_run_peers", fake, later, subkey=store.owner)
        # the honest peer's id as a plain subkey: stored, but nobody reads an unsigned record
        assert forger.store("t_run_peers", fake, later, subkey=me)
        # the forger's own signed record, malformed: ignored too
        assert HivemindStore(forger).put(
            "t_run_peers", fake | {"step": "1"}, later, subkey=forger.identity.peer_id
        )
        with pytest.raises(ValueError):
            HivemindStore(forger).put("t_run_peers", fake, later, subkey=me)
        for reader in (honest, forger):
            beats = read_heartbeats(reader, "t_run")
            assert set(beats) == {me} and beats[me][0].step == 5 and beats[me][0].loss is None
        # leaving takes effect at once (a shorter-lived record would be ignored by hivemind)
        withdraw_heartbeat(honest, "t_run", me, hb, ttl_s=30)
        assert read_heartbeats(forger, "t_run") == {}
    finally:
        forger.shutdown()
        honest.shutdown()


def test_with_more_nodes_than_a_crawl_keeps_every_read_finds_every_peers_record():
    """Reads and writes crawl with hivemind's ``beam_size`` set to ``CRAWL_BEAM``, not its bucket size:
    with more nodes than that, every node still reads every node's heartbeat. (What the narrower crawl
    saves is measured by ``benchmarks/heartbeats.py``.)"""
    nodes = [start_dht()]
    nodes += [start_dht(visible_maddrs(nodes[0])) for _ in range(CRAWL_BEAM + 1)]
    try:
        stores = [HivemindStore(d) for d in nodes]
        for i, store in enumerate(stores):
            assert publish_heartbeat(store, "t_crawl", store.me, Heartbeat(experts=[i], state="training"), 30)
        for store in stores:
            beats = read_heartbeats(store, "t_crawl")
            assert {p: hb.experts for p, (hb, _) in beats.items()} == {
                s.me: [i] for i, s in enumerate(stores)
            }
    finally:
        for d in reversed(nodes):
            d.shutdown()
