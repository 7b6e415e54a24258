"""Downloads of non-local experts on the in-process transport: what travels while a holder is not fresh."""

import threading
import time

import torch

from swarm.net.expert_download import ExpertDownloads, Fresh
from swarm.net.expert_server import ExpertServer
from swarm.net.local_transport import LocalNetwork


def _holder(net: LocalNetwork) -> ExpertServer:
    return ExpertServer(net.transport("b").open_server("t_experts"))


def _moved(net: LocalNetwork) -> list[int]:
    return [values for who, peer, name, values in net.fetched if (who, peer, name) == ("a", "b", "t_experts")]


def test_polls_for_a_fresh_copy_move_metadata_until_the_copy_is_fresh():
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.6)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)  # last round's copy
    # the holder finishes this round's average 1.2 s later
    threading.Timer(1.2, server.update, ({"expert3": [torch.full((8, 4), 0.75)]}, 100, False)).start()
    got, rejected, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, False, time.monotonic() + 5)
    assert rejected == failures == [] and got[3][0].tolist() == [[0.75] * 4] * 8
    polls = _moved(net)
    assert len(polls) >= 3 and polls[:-1] == [0] * (len(polls) - 1) and polls[-1] == 32, polls
    assert downloads.received == 32 * 2  # fp16, once


def test_a_holder_behind_us_is_taken_as_it_is_and_a_final_copy_is_awaited_after_one_whole_answer():
    net = LocalNetwork()
    server, downloads = _holder(net), ExpertDownloads(net.transport("a"), "t_experts", 5.0, 4.0)
    mine = {3: [torch.full((8, 4), 0.6)]}
    server.update({"expert3": [torch.full((8, 4), 0.5)]}, step=90, final=False)
    got, _, failures = downloads.fetch({3: [("b", 90)]}, mine, 100, False, time.monotonic() + 5)
    assert failures == [] and got[3][0].tolist() == [[0.5] * 4] * 8 and _moved(net) == [32]
    # after the last round: the first answer comes whole (kept if the holder never settles), then metadata
    # only until the copy is final
    threading.Timer(1.2, server.update, ({"expert3": [torch.full((8, 4), 0.25)]}, 100, True)).start()
    got, _, failures = downloads.fetch({3: [("b", 100)]}, mine, 100, True, time.monotonic() + 5)
    polls = _moved(net)[1:]
    assert failures == [] and got[3][0].tolist() == [[0.25] * 4] * 8
    assert polls[0] == 32 and polls[-1] == 32 and set(polls[1:-1]) == {0} and len(polls) >= 3, polls
    # a holder that never settles: the newest copy it served, and the failure said
    server.update({"expert3": [torch.full((8, 4), 0.125)]}, step=110, final=False)
    got, _, failures = downloads.fetch({3: [("b", 110)]}, mine, 110, True, time.monotonic() + 1.5)
    assert got[3][0].tolist() == [[0.125] * 4] * 8


def test_fresh_reads_served_metadata_and_refuses_what_is_malformed():
    meta = {"items": ["expert1", "expert3"], "steps": [100, 90], "final": [False, True]}
    assert Fresh(("expert1",), 100, final=False)(meta)
    assert not Fresh(("expert1", "expert3"), 100, final=False)(meta)
    assert Fresh(("expert1", "expert3"), None, final=False)(meta)
    assert Fresh(("expert3",), None, final=True)(meta) and not Fresh(("expert1",), None, final=True)(meta)
    assert not Fresh(("expert2",), None, final=False)(meta)
    for bad in ({}, {"items": "expert1", "steps": [1], "final": [0]}, {"items": ["expert1"], "steps": ["x"]}):
        assert not Fresh(("expert1",), None, final=False)(bad)
