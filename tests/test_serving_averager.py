"""Whose steps meet whose on hivemind's real averagers and p2pd (``swarm.net.serving_averager``): a last
round's matchmaking key is its own; an ask for a fresher copy is held until the holder serves one. Serving, ruled all-reduce and met-early groups have tests of their own
(``test_hivemind_transport``, ``test_ruled_allreduce``, ``test_prematch``)."""

import threading
import time

import pytest
import torch

from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.hivemind_group import close_groups
from swarm.net.hivemind_transport import HivemindTransport
from swarm.net.served_steps import Fresh
from swarm.net.serving_averager import HOLD_MAX_S
from swarm.net.timing import Timing

pytestmark = pytest.mark.timeout(120)
TIMING = Timing(matchmaking_s=2.0, round_s=30.0, download_s=20.0, heartbeat_s=1.0, request_s=1.0,
                final_agreement_s=5.0)  # fmt: skip


@pytest.fixture(scope="module")
def dhts():
    """Four DHT nodes (and p2pds) on 127.0.0.1, shared by this file's tests: each opens groups of its own."""
    first = start_dht()
    nodes = [first, *(start_dht(visible_maddrs(first)) for _ in range(3))]
    yield nodes
    for d in reversed(nodes):
        d.shutdown()


def test_last_rounds_and_ordinary_rounds_look_for_members_under_different_keys(dhts):
    """Two peers in their last round and two in an ordinary one, all looking at once for a group that
    each view says has four members: the last rounds average as one pair and the ordinary ones as another
    (under one key hivemind puts any of them together, and every member drops a group that mixes the two:
    the end of 2 of 5 wan.py runs on H100 peers). After a last round the same averager meets ordinary
    rounds again."""
    groups = [HivemindTransport(d, TIMING).open("t_last", [torch.zeros(100)]) for d in dhts]
    try:
        for last_ones in ((0, 2), ()):
            handles = [
                g.start(
                    [torch.full((100,), float(i))], {"i": i, "last": i in last_ones}, 4.0, None, expected=4
                )
                for i, g in enumerate(groups)
            ]
            outcomes = [g.outcome(h, timeout=20) for g, h in zip(groups, handles, strict=True)]
            for i, out in enumerate(outcomes):
                assert out.ok, out.reason
                if last_ones:
                    together = [j for j in range(4) if (j in last_ones) == (i in last_ones)]
                else:
                    together = [0, 1, 2, 3]
                assert sorted(v["i"] for v in out.members.values()) == together, (i, out.members)
                assert torch.equal(out.tensors[0], torch.full((100,), sum(together) / len(together)))
            time.sleep(0.5)
    finally:
        close_groups(groups)


def test_a_step_scheduled_later_waits_for_members_that_come_apart_and_begins_once_all_are_in(dhts):
    """Peers reach their step limits seconds apart: ``run_round`` schedules a last round's step most of its
    window ahead. hivemind's leader then waits until then for followers rather than its own matchmaking time
    (2 s here), and begins as soon as the expected members are in. Unscheduled, the first two formed a pair
    after 2 s and the third was left alone."""
    groups = [HivemindTransport(d, TIMING).open("t_apart", [torch.zeros(100)]) for d in dhts[:3]]
    try:
        window, handles = 12.0, []
        for i, g in enumerate(groups):
            if i:
                time.sleep(2.5)  # the others' finishing steps come later
            info = {"i": i, "last": True}
            handles.append(
                g.start([torch.full((100,), float(i))], info, window, time.time() + 0.9 * window, 3)
            )
        began = time.monotonic()
        outcomes = [g.outcome(h, timeout=20) for g, h in zip(groups, handles, strict=True)]
        for out in outcomes:
            assert out.ok, out.reason
            assert sorted(v["i"] for v in out.members.values()) == [0, 1, 2], out.members
            assert torch.equal(out.tensors[0], torch.full((100,), 1.0))
        assert time.monotonic() - began < 5.0  # once the third was in, not at the end of the window
    finally:
        close_groups(groups)


def test_an_averager_never_lists_itself_for_hivemind_state_downloads(dhts):
    """hivemind's averager stores itself under ``<prefix>.all_averagers`` at start, every declare period and
    after every averaged tensor; downloads here ask a holder by name, so none of it may reach the DHT (it was
    9222 DHT lookups in a 2-minute demo instead of 2170)."""
    groups = [
        HivemindTransport(d, TIMING).open("t_listed", [torch.zeros(10), torch.zeros(10)]) for d in dhts[:2]
    ]
    try:
        handles = [g.start([torch.full((10,), float(i))] * 2, {"i": i}, 4.0, None, expected=2) for i, g in
                   enumerate(groups)]  # fmt: skip
        for g, h in zip(groups, handles, strict=True):
            out = g.outcome(h, timeout=20)
            assert out.ok and torch.equal(out.tensors[1], torch.full((10,), 0.5)), out.reason
        for d in dhts:
            assert d.get("t_listed.all_averagers", latest=True) is None
    finally:
        close_groups(groups)


def test_an_ask_for_a_fresher_copy_is_held_until_the_holder_serves_one(dhts):
    """A refused ask with ``hold_s`` is answered again as soon as what the holder serves changes: the new
    copy comes in that one fetch. Unheld, the same ask comes back with the metadata alone; held longer than
    the holder holds anyone (``HOLD_MAX_S``), it comes back with the metadata alone too, not cut off by
    its timeout."""
    holder = HivemindTransport(dhts[0], TIMING).open_server("t_held")
    asker, at = HivemindTransport(dhts[1], TIMING), dhts[0].peer_id.to_base58()

    def serve(step: int) -> None:
        copy = [torch.full((1000,), float(step), dtype=torch.float16)]
        holder.serve(copy, {"items": ["expert0"], "steps": [step], "final": [False]})

    try:
        serve(1)
        assert asker.fetch(at, "t_held", timeout=10).meta["steps"] == [1]
        step2 = Fresh(("expert0",), 2, final=False)
        unheld = asker.fetch(at, "t_held", 10, step2)
        assert unheld.meta["steps"] == [1] and unheld.tensors == [] and unheld.held_s == 0.0
        threading.Timer(1.5, serve, (2,)).start()
        held = asker.fetch(at, "t_held", 10, step2, hold_s=8.0)
        assert held.meta["steps"] == [2] and held.tensors[0].tolist() == [2.0] * 1000
        assert held.held_s > 0
        t0 = time.monotonic()
        beyond = asker.fetch(at, "t_held", 3 * HOLD_MAX_S, Fresh(("expert0",), 3, final=False), hold_s=30.0)
        assert beyond is not None and beyond.meta["steps"] == [2] and beyond.tensors == []
        assert time.monotonic() - t0 >= HOLD_MAX_S  # it was held, up to the holder's bound
    finally:
        close_groups([holder])


def test_only_an_empty_message_ends_a_copy():
    """``COPY_END`` is told from every message a copy is made of: metadata alone (a hold in vain), a tensor's
    first part (its dtype), a later part (bytes only), and an empty tensor's part."""
    from hivemind.proto import averaging_pb2, runtime_pb2

    from swarm.net.serving_averager import COPY_END, is_copy_end

    parts = [
        averaging_pb2.DownloadData(metadata=b"\x80"),
        averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(dtype="float16", size=[0])),
        averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\x00\x3c")),
    ]
    assert is_copy_end(COPY_END) and not any(is_copy_end(m) for m in parts)
    assert is_copy_end(averaging_pb2.DownloadData.FromString(COPY_END.SerializeToString()))  # as it arrives
