"""The round's protocol rules, in process, on the fault-injecting ``LocalNetwork`` (seconds, no sockets)."""

import threading
import time

import pytest
import torch

from swarm.config import SyncConfig
from swarm.net.expert_download import ExpertDownloads, ExpertServer
from swarm.net.group_layout import DENSE, OpenGroups, expert_item, layout
from swarm.net.local_transport import Fault, LocalNetwork
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat
from swarm.net.round import RoundContext, RoundPlan, run_round
from swarm.net.timing import Timing

pytestmark = pytest.mark.timeout(60)

N_EXPERTS = 4
TIMING = Timing(
    matchmaking_s=0.3, round_s=3.0, download_s=1.0, heartbeat_s=0.2, request_s=0.2, final_agreement_s=1.0
)


def _expert(seed: int) -> list[torch.Tensor]:  # two layers: (gate_up, down) each
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)] * 2


class Swarm:
    """Peers on one ``LocalNetwork``, each with its own dense weights and copies of every expert."""

    def __init__(self, experts: dict[str, list[int]], faults=(), sync: SyncConfig | None = None):
        self.net = LocalNetwork(matchmaking_s=TIMING.matchmaking_s, faults=faults)
        self.experts, self.sync = experts, sync or SyncConfig(max_rel_distance=4.0)
        self.ctx, self.dense, self.copies = {}, {}, {}
        for i, me in enumerate(experts):
            transport = self.net.transport(me)
            server = ExpertServer(transport.open_server("t_experts"))
            downloads = ExpertDownloads(transport, "t_experts", TIMING.download_s, 4.0)
            self.ctx[me] = RoundContext(
                "t",
                me,
                self.net.store(me),
                TIMING,
                self.sync,
                N_EXPERTS,
                OpenGroups(transport),
                server,
                downloads,
            )
            self.dense[me] = [torch.randn(6, 5, generator=torch.Generator().manual_seed(100 + i))]
            self.copies[me] = {e: _expert(1000 * i + e) for e in range(N_EXPERTS)}
        holders = {e: frozenset(p for p, ex in experts.items() if e in ex) for e in range(N_EXPERTS)}
        beats = {p: Heartbeat(experts=ex, step=10, state="training") for p, ex in experts.items()}
        self.view = MembershipView(beats, holders, {})

    def plan(self, me: str, index: int = 1, weights: dict[str, float] | None = None, last: bool = False):
        local = self.experts[me]
        w = {DENSE: 1.0} | {expert_item(e): 1.0 for e in local} | (weights or {})
        specs, sole = layout("t", me, local, self.view.holders)
        like = {DENSE: self.dense[me]} | {expert_item(e): self.copies[me][e] for e in local}
        groups = [(s, self.ctx[me].groups.get(s, like)) for s in specs]
        frozen = {e: self.copies[me][e] for e in range(N_EXPERTS) if e not in local}
        return RoundPlan(index, 10, self.dense[me], {e: self.copies[me][e] for e in local}, frozen, w,
                         groups, sole, None, last)  # fmt: skip

    def round(self, plans: dict[str, RoundPlan]):
        results, threads = {}, []
        for me, plan in plans.items():
            run = lambda me=me, plan=plan: results.__setitem__(me, run_round(plan, self.ctx[me], self.view))  # noqa: E731
            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return results


def _weighted_mean(parts: list[tuple[float, list[torch.Tensor]]]) -> list[torch.Tensor]:
    total = sum(w for w, _ in parts)
    return [sum(w * ts[i] for w, ts in parts) / total for i in range(len(parts[0][1]))]


@pytest.mark.parametrize("r", [2, 4])
def test_replicated_experts_average_to_the_exact_weighted_mean(r):
    peers = ["a", "b", "c", "d"]
    experts = {p: [e for e in range(N_EXPERTS) if (e - i) % (4 // r) == 0] for i, p in enumerate(peers)}
    swarm = Swarm(experts)
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 0.5 + e + i for e in experts[p]}} for i, p in enumerate(peers)
    }
    results = swarm.round({p: swarm.plan(p, weights=weights[p]) for p in peers})
    want_dense = _weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    for p in peers:
        rec = results[p].record
        assert rec.rejected == [] and rec.dense_group == 4, rec
        for got, want in zip(results[p].dense[1], want_dense, strict=True):
            assert torch.allclose(got, want, atol=1e-6)
        for e in experts[p]:
            holders = [q for q in peers if e in experts[q]]
            assert rec.expert_groups[str(e)] == r
            want = _weighted_mean([(weights[q][expert_item(e)], swarm.copies[q][e]) for q in holders])
            for got, w in zip(results[p].experts[e][1], want, strict=True):
                assert torch.allclose(got, w, atol=1e-6)
    # one averaging group for the dense weights and one per holder set, whatever the number of experts
    assert (
        len({s.name for p in peers for s in layout("t", p, experts[p], swarm.view.holders)[0]}) == 1 + 4 // r
    )


@pytest.mark.parametrize("kind", ["partial", "drop", "nan", "silent"])
def test_a_faulty_member_makes_every_member_drop_the_round(kind):
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault(kind, peer="b", round=None if kind == "silent" else 1)])
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers if kind != "silent" else ["a", "c"]:  # a silent member sees the others' digests
        rec = results[p].record
        assert results[p].dense is None, (p, rec)
        assert any(r.startswith("dense") for r in rec.rejected), (p, rec.rejected)
    assert results["a"].experts == {} and results["c"].dense is None
    if kind == "silent":  # it stays silent
        return
    # the next round, without the fault, is clean
    results = swarm.round({p: swarm.plan(p, index=2) for p in peers})
    assert all(results[p].record.rejected == [] and results[p].dense is not None for p in peers)


def test_a_weight_not_claimed_is_rejected():
    peers = {"a": [0], "b": [1]}
    swarm = Swarm(peers, faults=[Fault("scale", peer="b", round=1, factor=30.0)])
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("weights averaged differ" in r for r in results[p].record.rejected), results[p].record


def test_a_last_round_never_mixes_with_an_ordinary_one():
    peers = {"a": [0, 1], "b": [2, 3]}
    swarm = Swarm(peers)
    results = swarm.round({"a": swarm.plan("a", last=True), "b": swarm.plan("b")})
    for p in peers:
        assert any("another kind of round" in r for r in results[p].record.rejected)


def test_a_late_member_is_abandoned_within_the_round_bound_and_the_next_round_runs():
    peers = {"a": [0, 1], "b": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("delay", peer="b", round=1, seconds=30.0)])
    t0 = time.monotonic()
    results = swarm.round({p: swarm.plan(p) for p in peers})
    assert time.monotonic() - t0 < TIMING.round_s + 2
    assert results["b"].dense is None and any("Timeout" in r for r in results["b"].record.rejected)
    assert results["a"].dense is None and any("no digest" in r for r in results["a"].record.rejected)
    results = swarm.round({p: swarm.plan(p, index=2) for p in peers})
    assert all(results[p].dense is not None for p in peers)


def test_non_local_experts_come_from_a_live_holder_as_fp16():
    peers = {"a": [0, 1], "b": [2, 3], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("dead", peer="b")])
    swarm.view.peers["b"].step = 20  # the freshest holder, asked first
    results = swarm.round({p: swarm.plan(p) for p in peers})
    got = results["a"].downloads
    assert sorted(got) == [2, 3]  # from c: b serves nothing
    averaged = results["c"].experts[2][1]
    for t, want in zip(got[2], averaged, strict=True):
        assert t.dtype == torch.float16 and torch.allclose(t.float(), want, atol=2e-3 * want.abs().max())
    assert any("no answer" in f for f in results["a"].record.download_failures)
    assert sorted(results["b"].downloads) == [0, 1] and sorted(results["c"].downloads) == [0, 1]


def test_a_holder_serving_some_of_our_own_experts_too_still_serves_the_rest():
    peers = {"a": [0, 1], "b": [1, 2], "c": [3]}
    swarm = Swarm(peers)
    results = swarm.round({p: swarm.plan(p) for p in peers})
    assert sorted(results["a"].downloads) == [2, 3]  # b serves 1 and 2; we hold 1
    assert results["a"].record.download_failures == []
