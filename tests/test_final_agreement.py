"""Settling the replicas after the last round, in process on the in-memory store and transport."""

import threading
import time

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


def _settle_expert3(failures: dict[str, int]) -> tuple[dict, dict]:
    """Three holders of expert3 (peer-c's copy the odd one out) settle it on the in-memory transport; a
    holder's first ``failures[me]`` downloads find nothing. Returns (results by holder, live copies)."""
    net = LocalNetwork()
    ids = ["peer-a", "peer-b", "peer-c"]
    live = {me: _copy(i) for i, me in enumerate(ids)}
    done = {}

    def holder(me: str) -> None:
        transport = net.transport(me)
        server = transport.open_server("t_experts")

        def fetch(peer, name):
            if failures.get(me, 0) > 0:
                failures[me] -= 1
                return None
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
    return done, live


def test_a_differing_replica_adopts_the_majority_copy():
    done, live = _settle_expert3({})
    assert done["peer-a"] == ([], []) and done["peer-b"] == ([], [])  # the two agreeing copies stay
    assert done["peer-c"] == (["expert3"], [])  # the odd one out takes theirs
    want = _copy(0)
    for i, me in enumerate(["peer-a", "peer-b", "peer-c"]):
        for got, ref in zip(live[me], want, strict=True):
            tol = 0 if i < 2 else 2e-3 * ref.abs().max().item()  # fp16 on the wire
            assert torch.allclose(got, ref, atol=tol, rtol=0)


def test_a_download_of_the_winning_copy_that_fails_once_is_tried_again():
    failures = {"peer-c": 1}  # peer-c's first download finds nothing (the holder is busy)
    done, _ = _settle_expert3(failures)
    assert failures["peer-c"] == 0 and done["peer-c"] == (["expert3"], [])


def test_holders_that_finish_late_are_waited_for_and_everyone_ends_with_one_copy():
    """Two pairs of holders, each pair equal after a last round of its own; the pair holding the smallest
    id ends its round 2.5 s after the other (past the 1 s read bound). Had the early pair decided without
    the late digests, it would have kept its copy while the late pair, seeing a 2-2 tie, kept theirs."""
    net = LocalNetwork()
    early, late = ["peer-c", "peer-d"], ["peer-a", "peer-b"]
    torch.manual_seed(0)
    copies = {"early": [torch.randn(300)], "late": [torch.randn(300)]}
    live = {me: [t.clone() for t in copies["early" if me in early else "late"]] for me in early + late}
    done = {}

    def holder(me: str) -> None:
        if me in late:
            time.sleep(2.5)
        transport = net.transport(me)
        server = transport.open_server("t_dense")

        def fetch(peer, name):
            served = transport.fetch(peer, "t_dense", timeout=1)
            return served.tensors if served is not None else None

        items = {"dense": FinalItem(live[me], frozenset(live) - {me})}
        serve = lambda name, tensors: server.serve(tensors, {"item": name})  # noqa: E731
        done[me] = agree_on_final_copies(net.store(me), "t_run", me, items, fetch, serve, 1.0, 4.0, wait=8.0)

    threads = [threading.Thread(target=holder, args=(me,)) for me in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert {me: done[me] for me in early} == {me: (["dense"], []) for me in early}
    assert {me: done[me] for me in late} == {me: ([], []) for me in late}
    for me in live:
        assert torch.equal(live[me][0], copies["late"][0]), me


def test_a_digest_that_never_comes_is_reported_unsettled():
    net = LocalNetwork()
    items = {"dense": FinalItem([torch.ones(10)], frozenset({"peer-gone"}))}
    started = time.monotonic()
    got = agree_on_final_copies(
        net.store("peer-a"),
        "t_run",
        "peer-a",
        items,
        lambda p, n: None,
        lambda n, t: None,
        0.5,
        4.0,
        wait=1.0,
    )
    assert got == ([], ["dense: no digest from 1 holder(s)"])
    assert 1.0 <= time.monotonic() - started < 3.0


def test_winner_is_the_largest_agreeing_set_then_the_smallest_id():
    a, b = digest([torch.ones(100)]), digest([torch.full((100,), 2.0)])
    assert winner({"Qb": a, "Qc": a, "Qa": b}) == "Qb"  # majority beats the smaller id
    assert winner({"Qb": a, "Qa": b}) == "Qa"  # a tie goes to the smallest id
    assert winner({"Qz": a}) == "Qz"


def test_a_store_that_fails_is_tried_again_while_the_holders_wait():
    """The late holder's first stores report failure (a loaded DHT: some nodes kept it, one did not answer):
    its digest still lands, and both settle. Like a hivemind node, the store refuses a value that expires
    no later than the one it holds, so a try must expire later than the last."""
    net = LocalNetwork()
    done, took = {}, {}

    class FlakyStore:  # the real in-memory store; its first store is lost, its second kept but reported lost
        def __init__(self, store):
            self.store, self.failures, self.expires = store, ["lost", "kept"], {}

        def put(self, key, value, expires_at, subkey=None, timeout=10.0):
            if expires_at <= self.expires.get(key, float("-inf")):
                return False
            failure = self.failures.pop(0) if self.failures else None
            if failure != "lost":
                self.expires[key] = expires_at
                self.store.put(key, value, expires_at, subkey=subkey, timeout=timeout)
            return failure is None

        def __getattr__(self, name):
            return getattr(self.store, name)

    def holder(me: str, store) -> None:
        items = {"dense": FinalItem([torch.ones(10)], frozenset({"peer-a", "peer-b"}) - {me})}
        started = time.monotonic()
        done[me] = agree_on_final_copies(store, "t_run", me, items, lambda p, n: None, lambda n, t: None, 0.5,
                                         4.0, wait=5.0, poll=0.05)  # fmt: skip
        took[me] = time.monotonic() - started

    threads = [
        threading.Thread(target=holder, args=("peer-a", net.store("peer-a"))),
        threading.Thread(target=holder, args=("peer-b", FlakyStore(net.store("peer-b")))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert done == {"peer-a": ([], []), "peer-b": ([], [])}
    # once stored, nobody waits on: not to the 5 s bound (a try of the same expiration is refused for ever)
    assert max(took.values()) < 4.0, took


def test_a_holder_no_longer_coming_is_waited_for_no_more():
    """Its heartbeat stops 0.5 s in (it crashed): the wait ends then, not at its 20 s bound."""
    net = LocalNetwork()
    items = {"dense": FinalItem([torch.ones(10)], frozenset({"peer-gone"}))}
    started = time.monotonic()
    got = agree_on_final_copies(
        net.store("peer-a"), "t_run", "peer-a", items, lambda p, n: None, lambda n, t: None, 0.5, 4.0,
        wait=20.0, poll=0.05, still_coming=lambda peer: time.monotonic() < started + 0.5,
    )  # fmt: skip
    assert got == ([], ["dense: no digest from 1 holder(s)"])
    assert 0.5 <= time.monotonic() - started < 3.0
