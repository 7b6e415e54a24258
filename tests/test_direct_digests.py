"""Round digests sent straight to the members: real DHT nodes and p2p daemons on 127.0.0.1."""

import functools
import time

import msgpack
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto.averaging_pb2 import DownloadData
from hivemind.utils.multiaddr import Multiaddr

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.direct_digests import HANDLER, MAX_KEYS_PER_PEER, DirectDigests, Mailbox
from swarm.net.round_consensus import MAX_PAIRS, await_digests, digest
from swarm.net.swarm_key import SwarmKey

pytestmark = pytest.mark.timeout(120)


def _shutdown(*dhts):
    for d in dhts:
        d.shutdown()


def test_members_agree_through_direct_messages_and_a_late_one_is_heard_when_asked_again():
    a = start_dht()
    b, c = start_dht(visible_maddrs(a)), start_dht(visible_maddrs(a))
    try:
        ids = [d.peer_id.to_base58() for d in (a, b, c)]
        da, db, dc = DirectDigests(a), DirectDigests(b), DirectDigests(c)
        mine = digest([torch.arange(1000.0)])
        assert da.publish("t_key", mine, ids, timeout=5.0)
        assert db.publish("t_key", mine, ids, timeout=5.0)
        # c has not published yet: a and b have each other's digest, pushed, and nothing from c
        deadline = time.monotonic() + 10
        while set(da.collect("t_key", ids, timeout=2.0)) != set(ids[:2]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(da.collect("t_key", ids, timeout=2.0)) == set(ids[:2])
        # c publishes a different result: a's wait ends with that member named
        other = digest([torch.arange(1000.0) + 1])
        assert dc.publish("t_key", other, ids, timeout=5.0)
        ok, why = await_digests(da, "t_key", ids[0], ids, mine, timeout=10.0, grace=0.3)
        assert ok and "1 differ" in why
        # a key that c publishes while a has stopped looking: a's next collect asks c again and gets it
        assert dc.publish("t_late", mine, [ids[2]], timeout=5.0)  # to nobody: only asking finds it
        ok, why = await_digests(da, "t_late", ids[0], [ids[0], ids[2]], mine, timeout=10.0)
        assert (ok, why) == (True, "")
        # a member that never publishes: no digest, and the wait ends at its timeout
        t0 = time.monotonic()
        ok, why = await_digests(db, "t_silent", ids[1], [ids[1], ids[0]], mine, timeout=1.5)
        assert not ok and "no digest" in why and time.monotonic() - t0 < 5.0
    finally:
        _shutdown(c, b, a)


async def _raw_call(_dht, node, to: str, addrs: list, blob: bytes | int) -> bytes:
    # an int: that many zero bytes, made here (a pipe message to the DHT's process must stay small)
    blob = b"\x00" * blob if isinstance(blob, int) else blob
    await node.p2p._client.connect(PeerID.from_base58(to), addrs)  # dialled by address: no DHT needed
    answer = await node.p2p.call_protobuf_handler(
        PeerID.from_base58(to), HANDLER, DownloadData(metadata=blob), DownloadData
    )
    return answer.metadata


def _send(dht, to: str, addrs: list, blob: bytes | int) -> bytes:
    """One raw message to ``to``'s digest handler from ``dht``'s process: what a hostile peer could send."""
    call = functools.partial(_raw_call, to=to, addrs=addrs, blob=blob)
    return dht.run_coroutine(call, return_future=True).result(timeout=10)


def test_with_a_swarm_key_only_members_are_heard_and_malformed_messages_are_dropped():
    key = SwarmKey.create()
    a = start_dht(swarm_key=key)
    b = start_dht(visible_maddrs(a), swarm_key=key)
    outsider = start_dht()  # no key: its DHT cannot join ours, but its p2p daemon can still dial a
    try:
        ia, ib, io = (d.peer_id.to_base58() for d in (a, b, outsider))
        addrs = [m.decapsulate(Multiaddr(f"/p2p/{ia}")) for m in a.get_visible_maddrs()]
        da, db = DirectDigests(a), DirectDigests(b)
        mine = digest([torch.ones(64)])
        assert da.publish("t_key", mine, [ia, ib], timeout=5.0)
        assert db.publish("t_key", mine, [ia, ib], timeout=5.0)
        ok, _ = await_digests(db, "t_key", ib, [ia, ib], mine, timeout=10.0)
        DirectDigests(outsider)  # its handler and mailbox, so that it could be answered
        # without a member token: not kept, and a's digest is not answered either
        assert _send(outsider, ia, addrs, msgpack.packb([b"", "t_key", mine])) == b""
        assert io not in da.collect("t_key", [ia, ib, io], timeout=2.0)
        # a stolen token of another peer does not help: the sender is who the connection says
        token_b = key.member_token(ib)
        assert _send(outsider, ia, addrs, msgpack.packb([token_b, "t_key", mine])) == b""
        # from a member (its token is good): a well-formed ask is answered with a's digest; malformed ones
        # (not msgpack, wrong shapes, a digest too long or not numbers, a huge message, made in b's process:
        # a pipe message over 16 KiB to a DHT's process is dropped) are answered with nothing and not kept
        assert msgpack.unpackb(_send(b, ia, addrs, msgpack.packb([token_b, "t_key", None]))) == mine
        for blob in (b"\xc1garbage", msgpack.packb({"x": 1}), msgpack.packb([token_b, 7, mine]),
                     msgpack.packb([token_b, "t_bad", [0.0] * (2 * MAX_PAIRS + 2)]),
                     msgpack.packb([token_b, "t_bad", ["x", 1.0]]), msgpack.packb([token_b, "t_bad", True]),
                     100_000):  # fmt: skip
            assert _send(b, ia, addrs, blob) == b""
        assert da.collect("t_bad", [ia, ib], timeout=2.0) == {}
        assert ok and set(da.collect("t_key", [ia, ib, io], timeout=2.0)) == {ia, ib}
    finally:
        _shutdown(outsider, b, a)


def test_the_mailbox_keeps_a_bounded_number_of_keys_per_sender():
    box = Mailbox("me")
    for i in range(MAX_KEYS_PER_PEER + 5):
        box.keep(f"k{i}", "flooder", [1.0, 2.0])
    box.keep("real", "member", [3.0, 4.0])
    held = [k for k, (_, senders) in box.boxes.items() if "flooder" in senders]
    assert len(held) == MAX_KEYS_PER_PEER and held[-1] == f"k{MAX_KEYS_PER_PEER + 4}"
    assert box.known("real") == {"member": [3.0, 4.0]}
