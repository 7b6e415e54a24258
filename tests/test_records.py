"""Heartbeat records as readers parse them: every field typed and in range, or the record is ignored."""

import math

import pytest

from swarm.net.local_transport import LocalNetwork
from swarm.net.records import (
    FingerprintMismatch,
    Heartbeat,
    check_or_publish_fingerprint,
    publish_heartbeat,
    read_heartbeats,
)

GOOD = Heartbeat(experts=[1, 2], step=5, tokens=640, loss=3.25, state="training", period_s=1.0).to_value()


def test_a_well_formed_record_parses_back_and_unknown_fields_are_ignored():
    hb = Heartbeat.from_value(GOOD | {"from_a_newer_version": 1})
    assert hb == Heartbeat.from_value(GOOD) and hb.experts == [1, 2] and hb.loss == 3.25
    assert Heartbeat.from_value(GOOD | {"loss": None, "last_round": -1}) is not None
    addrs = ["/ip4/127.0.0.1/tcp/4001/p2p/QmPeer", "/ip6/::1/tcp/4001/p2p/QmPeer"]
    assert Heartbeat.from_value(GOOD | {"addrs": addrs}).addrs == addrs


@pytest.mark.parametrize(
    "field,value",
    [
        ("step", "5"),  # the attack that crashed round threads: a string where a number belongs
        ("step", -1),
        ("step", 2**70),
        ("step", True),
        ("step", 1.5),
        ("tokens", None),
        ("loss", "low"),
        ("loss", math.inf),
        ("loss", math.nan),
        ("tokens_per_s", -3.0),
        ("period_s", [1]),
        ("last_round", -2),
        ("sent_at", {"t": 1}),
        ("state", "owner"),
        ("experts", [1, 1]),
        ("experts", [-1]),
        ("experts", [5000]),
        ("experts", ["1"]),
        ("experts", [False]),
        ("experts", [[1]]),  # unhashable: must not raise while checking for duplicates
        ("experts", [{"e": 1}]),
        ("experts", list(range(5000))),
        ("experts", "0,1"),
        ("addrs", "/ip4/127.0.0.1/tcp/1"),
        ("addrs", [5]),
        ("addrs", ["ip4/127.0.0.1"]),  # not a multiaddr
        ("addrs", ["/ip4/1.2.3.4/tcp/1\n<script>"]),
        ("addrs", ["/" + "x" * 300]),
        ("addrs", [f"/ip4/127.0.0.1/tcp/{i}" for i in range(9)]),
    ],
)
def test_a_record_with_any_malformed_field_is_ignored_whole(field, value):
    assert Heartbeat.from_value(GOOD | {field: value}) is None


@pytest.mark.parametrize("value", [None, 7, "x", [1, 2], {"step": 3}, b"\x00"])
def test_anything_that_is_not_a_record_is_ignored(value):
    assert Heartbeat.from_value(value) is None


def test_readers_skip_malformed_records_and_say_so_once(caplog):
    net = LocalNetwork()
    store = net.store("a")
    publish_heartbeat(store, "r", "a", Heartbeat(experts=[0], step=3, state="training"), ttl_s=30)
    forger = net.store("forger")
    forger.put("r_peers", GOOD | {"step": "1000000000"}, store.now() + 30, subkey="forger")
    with pytest.raises(ValueError):  # nobody writes another peer's record (on hivemind: signed subkeys)
        forger.put("r_peers", GOOD | {"step": 10**9}, store.now() + 30, subkey="a")
    with caplog.at_level("WARNING", logger="swarm.net.records"):
        for _ in range(3):
            assert set(read_heartbeats(store, "r")) == {"a"}
    assert len([r for r in caplog.records if "forger" in r.getMessage()]) == 1


def test_a_runs_fingerprint_is_each_peers_own_record_and_one_writer_cannot_lock_the_run():
    net = LocalNetwork()
    check_or_publish_fingerprint(net.store("a"), "r", "a", "model-1")  # the first peer publishes
    check_or_publish_fingerprint(net.store("b"), "r", "b", "model-1")
    stranger = net.store("x")  # writes another fingerprint, without asking
    stranger.put("r_config", "locked", stranger.now() + 60, subkey="x")
    check_or_publish_fingerprint(net.store("c"), "r", "c", "model-1")  # joins: the run has its peers
    with pytest.raises(FingerprintMismatch, match=r"fingerprint model-1 from 3 peer\(s\), ours model-2"):
        check_or_publish_fingerprint(net.store("d"), "r", "d", "model-2")
    assert set(net.store("a").get_subkeys("r_config")) == {"a", "b", "x", "c"}  # d published nothing
