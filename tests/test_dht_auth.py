"""A swarm with a key, on real hivemind nodes (127.0.0.1): strangers can neither read, write, join nor
download; with an allowlist, a holder of the key who is not listed is turned away too."""

import time

import hivemind
import pytest
import torch

from swarm.net.dht_node import DHTStartError, start_dht, visible_maddrs
from swarm.net.hivemind_group import HivemindGroup, download_state
from swarm.net.hivemind_transport import HivemindStore
from swarm.net.p2p_sockets import YOUNG_S, p2p_sockets, stale_p2p_sockets
from swarm.net.swarm_key import SwarmKey

pytestmark = pytest.mark.timeout(180)


def _stranger(maddrs) -> hivemind.DHT:
    """A plain hivemind node, as anyone could run: no key, our address as initial peer."""
    return hivemind.DHT(
        initial_peers=maddrs, start=True, ensure_bootstrap_success=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )


def test_without_the_key_a_node_cannot_join_read_write_or_download():
    key = SwarmKey.create()
    a = start_dht(swarm_key=key)
    b = start_dht(visible_maddrs(a), swarm_key=key)
    stranger = _stranger(visible_maddrs(a))
    group = HivemindGroup(a, "t_experts", None)
    try:
        store_a, store_b = HivemindStore(a), HivemindStore(b)
        assert store_a.put("t_run_peers", {"step": 1}, time.time() + 60, subkey=store_a.me)
        assert set(store_b.get_subkeys("t_run_peers")) == {store_a.me}  # members read each other
        # a node with no key, or another one, cannot start through a member: one clear error, and the
        # daemon of the node that failed leaves no socket behind (it did in about half of the tries)
        sockets = p2p_sockets()
        for wrong in (None, SwarmKey.create()):
            with pytest.raises(DHTStartError, match="swarm key"):
                start_dht(visible_maddrs(a), swarm_key=wrong, wait_timeout=20)
        time.sleep(YOUNG_S + 0.1)  # younger sockets are not judged
        assert not stale_p2p_sockets(sockets)
        # the stranger reads nothing and what it writes reaches no member
        assert stranger.get("t_run_peers", latest=True) is None
        stranger.store("t_run_peers", {"step": 10**9}, time.time() + 60, subkey=b"forged")
        stranger.store("t_run_config", "locked", time.time() + 60)
        assert set(store_b.get_subkeys("t_run_peers")) == {store_a.me} and store_b.get("t_run_config") is None
        # a served copy goes to members only
        group.serve([torch.ones(64, dtype=torch.float16)], {"items": ["expert0"], "steps": [1], "final": [0]})
        got = download_state(b, store_a.me, "t_experts", timeout=10)
        assert got is not None and got[0]["items"] == ["expert0"] and len(got[1]) == 1
        refused = download_state(stranger, store_a.me, "t_experts", timeout=10)
        assert refused is None or (not refused[1] and not refused[0]), refused
    finally:
        group.close()
        for node in (stranger, b, a):
            node.shutdown()


def test_with_an_allowlist_an_unlisted_holder_of_the_key_never_averages_with_members(tmp_path):
    key = SwarmKey.create()
    key.write(tmp_path / "swarm.key")
    nodes = [start_dht(swarm_key=key)]
    nodes += [start_dht(visible_maddrs(nodes[0]), swarm_key=key) for _ in range(2)]
    listed = [n.peer_id.to_base58() for n in nodes[:2]]
    (tmp_path / "peers.txt").write_text("\n".join(listed))
    closed = SwarmKey.load(tmp_path / "swarm.key", allow=tmp_path / "peers.txt")
    for n in nodes[:2]:  # the listed members know the list; the outsider takes anyone
        n.swarm_key = closed
    groups = [HivemindGroup(n, "t_closed", [torch.zeros(8)], matchmaking_time=3.0) for n in nodes]
    try:
        HivemindStore(nodes[2]).put(
            "t_peers", {"step": 1}, time.time() + 60, subkey=nodes[2].peer_id.to_base58()
        )
        assert HivemindStore(nodes[0]).get_subkeys("t_peers") == {}  # its records are not read
        outcomes = []
        for _ in range(2):
            handles = [
                g.start([torch.full((8,), float(i + 1))], {"i": i}, 3.0, expected=2 + (i == 2))
                for i, g in enumerate(groups)
            ]
            outcomes.append([g.outcome(h, 30) for g, h in zip(groups, handles, strict=True)])
        member_outcomes = [o for round_ in outcomes for o in round_[:2]]
        for o in member_outcomes:  # never with the outsider, and a group of the two averages them exactly
            assert nodes[2].peer_id.to_base58() not in o.members
            if o.ok:
                assert sorted(o.members) == sorted(listed) and torch.allclose(
                    o.tensors[0], torch.full((8,), 1.5)
                )
        assert all(o.ok for o in member_outcomes), [o.reason for o in member_outcomes]
        assert not any(round_[2].ok for round_ in outcomes), [r[2].reason for r in outcomes]
    finally:
        for g in groups:
            g.close()
        for n in reversed(nodes):
            n.shutdown()
