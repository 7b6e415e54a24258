"""Settling the replicas after the last round, in process on the in-memory store and transport."""

import threading

import pytest
import torch

from swarm.net.final_agreement import FinalItem, agree_on_final_copies, winner
from swarm.net.local_transport import LocalNetwork
from swarm.net.round_consensus import digest

pytestmark = pytest.mark.timeout(60)


def _copy(i: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    tensors = [torch.randn(5000), torch.randn(40, 30)]
    if i == 2:  # this holder's last round failed: its copy is its own
        tensors = [t + 0.05 * torch.randn_like(t) for t in tensors]
    return tensors


def test_a_differing_replica_adopts_the_majority_copy():
    net = LocalNetwork()
    ids = ["peer-a", "peer-b", "peer-c"]
    live = {me: _copy(i) for i, me in enumerate(ids)}
    done = {}

    def holder(me: str) -> None:
        transport = net.transport(me)
        server = transport.open_server("t_experts")

        def fetch(peer, name):
            served = transport.fetch(peer, "t_experts", timeout=5)
            return served.tensors if served is not None and served.meta.get("item") == name else None

        def serve(name, tensors):
            server.serve([t.half() for t in tensors], {"item": name})  # expert copies travel as fp16

        items = {"expert3": FinalItem(live[me], frozenset(ids) - {me})}
        done[me] = agree_on_final_copies(net.store(me), "t_run", me, items, fetch, serve, 5.0, 4.0)

    threads = [threading.Thread(target=holder, args=(me,)) for me in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert done["peer-a"] == ([], []) and done["peer-b"] == ([], [])  # the two agreeing copies stay
    assert done["peer-c"] == (["expert3"], [])  # the odd one out takes theirs
    want = _copy(0)
    for i, me in enumerate(ids):
        for got, ref in zip(live[me], want, strict=True):
            tol = 0 if i < 2 else 2e-3 * ref.abs().max().item()  # fp16 on the wire
            assert torch.allclose(got, ref, atol=tol, rtol=0)


def test_winner_is_the_largest_agreeing_set_then_the_smallest_id():
    a, b = digest([torch.ones(100)]), digest([torch.full((100,), 2.0)])
    assert winner({"Qb": a, "Qc": a, "Qa": b}) == "Qb"  # majority beats the smaller id
    assert winner({"Qb": a, "Qa": b}) == "Qa"  # a tie goes to the smallest id
    assert winner({"Qz": a}) == "Qz"
