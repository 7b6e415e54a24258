"""Settling the replicas after the last round, with real hivemind processes on 127.0.0.1."""

import multiprocessing as mp
import time

import pytest
import torch

from swarm.net.averaging import AveragingGroup
from swarm.net.dht_node import start_dht, visible_maddrs
from swarm.net.final_agreement import FinalGroup, agree_on_final_copies, winner
from swarm.net.round_consensus import digest

pytestmark = pytest.mark.timeout(180)


def _copy(i: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    tensors = [torch.randn(5000), torch.randn(40, 30)]
    if i == 2:  # this holder's last round failed: its copy is its own
        tensors = [t + 0.05 * torch.randn_like(t) for t in tensors]
    return tensors


def _holder(i, maddrs, inbox, out):
    dht = start_dht(maddrs)
    try:
        live = _copy(i)
        group = AveragingGroup(dht, "t_final_expert3", live, matchmaking_time=3.0, allreduce_timeout=30)
        out.put(("id", i, dht.peer_id.to_base58()))
        ids = inbox.get(timeout=60)
        me = dht.peer_id.to_base58()

        adopted, unsettled = agree_on_final_copies(
            dht,
            "t_run",
            me,
            {"expert3": FinalGroup(group, live, set(ids) - {me})},
            {"step": 9, "final": True},
            timeout=10.0,
            max_rel_distance=4.0,
        )
        out.put(("done", i, adopted, unsettled, [t.tolist() for t in live]))
        time.sleep(8)  # keep serving while the others download
        group.shutdown()
    finally:
        dht.shutdown()


def test_a_differing_replica_adopts_the_majority_copy():
    boot = start_dht()
    ctx = mp.get_context("fork")
    out, inboxes = ctx.Queue(), [ctx.Queue() for _ in range(3)]
    procs = [ctx.Process(target=_holder, args=(i, visible_maddrs(boot), inboxes[i], out)) for i in range(3)]
    try:
        for p in procs:
            p.start()
        ids = [out.get(timeout=90)[2] for _ in procs]
        for q in inboxes:
            q.put(ids)
        done = {msg[1]: msg[2:] for msg in (out.get(timeout=90) for _ in procs)}
        assert done[0][:2] == ([], []) and done[1][:2] == ([], [])  # the two agreeing copies stay
        assert done[2][:2] == (["expert3"], [])  # the odd one out takes theirs
        want = _copy(0)
        for i in range(3):
            for got, ref in zip(done[i][2], want, strict=True):
                tol = 0 if i < 2 else 2e-3 * ref.abs().max().item()  # fp16 on the wire
                assert torch.allclose(torch.tensor(got), ref, atol=tol, rtol=0)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        boot.shutdown()


def test_winner_is_the_largest_agreeing_set_then_the_smallest_id():
    a, b = digest([torch.ones(100)]), digest([torch.full((100,), 2.0)])
    assert winner({"Qb": a, "Qc": a, "Qa": b}) == "Qb"  # majority beats the smaller id
    assert winner({"Qb": a, "Qa": b}) == "Qa"  # a tie goes to the smallest id
    assert winner({"Qz": a}) == "Qz"
