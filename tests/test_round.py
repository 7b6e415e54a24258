"""The round's protocol rules, in process, on the fault-injecting ``LocalNetwork`` (seconds, no sockets)."""

import dataclasses
import threading
import time

import pytest
import torch

from swarm.config import SyncConfig
from swarm.net.expert_download import ExpertDownloads
from swarm.net.expert_server import ExpertServer
from swarm.net.group_layout import DENSE, OpenGroups, expert_item, layout
from swarm.net.local_transport import Fault, LocalNetwork
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat
from swarm.net.round import RoundContext, RoundPlan, run_round
from swarm.net.timing import Timing
from swarm.sync.codecs import codec_named
from swarm.sync.robust_mean import aggregation_rule

pytestmark = pytest.mark.timeout(60)

N_EXPERTS = 4
TIMING = Timing(
    matchmaking_s=0.3, round_s=3.0, download_s=1.0, heartbeat_s=0.2, request_s=0.2, final_agreement_s=1.0
)


def _expert(seed: int) -> list[torch.Tensor]:  # two layers: (gate_up, down) each
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)] * 2


def _near(base: list[torch.Tensor], seed: int, scale: float = 0.5) -> list[torch.Tensor]:
    """A peer's copy of shared weights: every peer's copies of an expert come from the same training, so
    that a holder's copy is a plausible later version of ours (``copy_doubt``), yet each peer's differs."""
    g = torch.Generator().manual_seed(seed)
    return [t + scale * torch.randn(t.shape, generator=g) for t in base]


class Swarm:
    """Peers on one ``LocalNetwork``, each with its own dense weights and copies of every expert."""

    def __init__(self, experts: dict[str, list[int]], faults=(), sync: SyncConfig | None = None):
        self.experts, self.sync = experts, sync or SyncConfig(max_rel_distance=4.0)
        codec = codec_named(self.sync.codec)
        rule = aggregation_rule(self.sync.aggregation, self.sync.clip_factor)
        self.net = LocalNetwork(matchmaking_s=TIMING.matchmaking_s, faults=faults, codec=codec, rule=rule)
        self.ctx, self.dense, self.copies = {}, {}, {}
        for i, me in enumerate(experts):
            transport = self.net.transport(me)
            deltas = None if codec.lossless else transport.open_server("t_expert_deltas", codec)
            server = ExpertServer(transport.open_server("t_experts"), deltas, codec)
            downloads = ExpertDownloads(
                transport, "t_experts", TIMING.download_s, 4.0, deltas and (deltas.name, codec)
            )
            self.ctx[me] = RoundContext(
                "t", me, self.net.store(me), TIMING, self.sync, N_EXPERTS, OpenGroups(transport), server, downloads
            )  # fmt: skip
            self.dense[me] = [torch.randn(6, 5, generator=torch.Generator().manual_seed(100 + i))]
            self.copies[me] = {e: _near(_expert(e), 1000 * i + e) for e in range(N_EXPERTS)}
        self.holders = {e: frozenset(p for p, ex in experts.items() if e in ex) for e in range(N_EXPERTS)}
        self.at_step(10)

    def at_step(self, step: int) -> None:
        """Every peer's heartbeat says ``step`` (a holder's copies are fresh from a round at that step)."""
        beats = {p: Heartbeat(experts=ex, step=step, state="training") for p, ex in self.experts.items()}
        self.view = MembershipView(beats, self.holders, {})

    def plan(self, me: str, index: int = 1, weights: dict[str, float] | None = None, last: bool = False,
             refresh: bool = True, step: int = 10):  # fmt: skip
        local = self.experts[me]
        w = {DENSE: 1.0} | {expert_item(e): 1.0 for e in local} | (weights or {})
        specs, sole = layout("t", me, local, self.view.holders)
        like = {DENSE: self.dense[me]} | {expert_item(e): self.copies[me][e] for e in local}
        groups = [(s, self.ctx[me].groups.get(s, like)) for s in specs]
        frozen = {e: self.copies[me][e] for e in range(N_EXPERTS) if e not in local}
        return RoundPlan(index, step, self.dense[me], {e: self.copies[me][e] for e in local}, frozen, w,
                         groups, sole, None, last, refresh=refresh)  # fmt: skip

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
    swarm = Swarm(experts, sync=SyncConfig(aggregation="mean"))
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 0.5 + e + i for e in experts[p]}} for i, p in enumerate(peers)
    }
    results = swarm.round({p: swarm.plan(p, weights=weights[p]) for p in peers})
    want_dense = _weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    for p in peers:
        rec = results[p].record
        assert rec.rejected == [] and rec.dense_group == 4, rec
        phases = rec.phase_seconds  # where the time went, adding up to the round's
        assert list(phases) == ["matchmaking", "allreduce", "checks", "downloads", "merge"], phases
        assert abs(sum(phases.values()) - rec.sync_seconds) < 0.01 and min(phases.values()) >= 0
        checks = rec.check_seconds  # within the checks (and, for all but the last group, the all-reduce)
        assert (
            sorted(checks) == ["await", "digest", "publish", "serve", "verify"] and min(checks.values()) >= 0
        )
        assert sum(checks.values()) <= phases["checks"] + phases["allreduce"] + 0.01, (checks, phases)
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


@pytest.mark.parametrize("factor", [3.0, -1.0, 1e30, float("nan")])
def test_with_centered_clipping_a_rogue_member_is_bounded_and_the_round_still_applies(factor):
    peers = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    swarm = Swarm(peers, faults=[Fault("scale", peer="b", factor=factor)])  # the default rule
    for i, p in enumerate(peers):  # one shared state, and each peer's own small change since
        g = torch.Generator().manual_seed(i)
        swarm.dense[p] = [t + 0.01 * torch.randn(t.shape, generator=g) for t in swarm.dense["a"]]
    weights = {"a": {DENSE: 1.0}, "b": {DENSE: 100.0}, "c": {DENSE: 0.5}}  # claims: all count 1
    results = swarm.round({p: swarm.plan(p, weights=weights[p]) for p in peers})
    honest = (swarm.dense["a"][0] + swarm.dense["c"][0]) / 2
    spread = (swarm.dense["a"][0] - swarm.dense["c"][0]).norm()
    plain = (swarm.dense["a"][0] + factor * swarm.dense["b"][0] + swarm.dense["c"][0]) / 3
    assert not (plain - honest).norm() <= 20 * spread  # what the mean would have let the rogue do
    for p in ("a", "c"):
        rec = results[p].record
        assert rec.rejected == [], rec.rejected
        assert (results[p].dense[1][0] - honest).norm() <= 2 * spread
        assert sorted(results[p].experts) == [0, 1]


def test_a_member_with_another_rule_makes_every_member_drop_the_round():
    peers = {"a": [0, 1], "b": [0, 1]}
    swarm = Swarm(peers)
    mean = dataclasses.replace(swarm.ctx["b"], sync=SyncConfig(aggregation="mean"))
    swarm.ctx["b"] = mean
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("another rule" in r for r in results[p].record.rejected), results[p].record.rejected


def test_a_member_that_exchanges_digests_another_way_makes_every_member_drop_the_round():
    """Its digest would never reach the others (nor theirs it): every member says why at once, instead of
    waiting until the round's deadline for a digest that cannot come."""
    peers = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    swarm = Swarm(peers)
    swarm.ctx["c"] = dataclasses.replace(swarm.ctx["c"], sync=SyncConfig(digests="dht"))
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("sync.digests" in r for r in results[p].record.rejected), results[p].record.rejected


def test_a_silent_member_vetoes_a_group_of_two_but_not_a_majority():
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("silent", peer="b")])  # it never publishes a digest
    results = swarm.round({p: swarm.plan(p) for p in peers})
    want = [torch.stack([swarm.dense[p][0] for p in peers]).mean(0)]
    for p in ("a", "c"):  # the dense group of three: two agree, the third is silent past the grace period
        assert torch.allclose(results[p].dense[1][0], want[0], atol=1e-6)
        assert not any(r.startswith("dense") for r in results[p].record.rejected), results[p].record
    # c is in no other group: its checks ended after the grace period, long before the deadline
    assert results["c"].record.phase_seconds["checks"] < TIMING.round_s / 3, results["c"].record
    # experts 0-1 are averaged by a and b alone: a cannot tell a silent b from a dead one, so drops them
    assert results["a"].experts == {}
    assert any("experts 0,1: partial round: no digest" in r for r in results["a"].record.rejected)


@pytest.mark.parametrize("heartbeat", ["stopped", "live"])
def test_a_silent_member_whose_heartbeat_stopped_is_not_awaited_until_the_deadline(heartbeat):
    """A pair whose other member went silent: if its heartbeat stopped too (killed), the round is dropped as
    soon as the view says so; if it still publishes heartbeats (slow), it is awaited until the deadline."""
    peers = {"a": [0, 1], "b": [0, 1]}
    swarm = Swarm(peers, faults=[Fault("silent", peer="b")])
    now = time.monotonic()
    last_heard = now - 10 * TIMING.record_ttl_s if heartbeat == "stopped" else now
    view = dataclasses.replace(swarm.view, heard_at={"a": now, "b": last_heard}, read_at=now)
    swarm.ctx["a"] = dataclasses.replace(swarm.ctx["a"], view_now=lambda: view)
    rec = swarm.round({p: swarm.plan(p) for p in peers})["a"].record
    assert [r.split(":")[0] for r in rec.rejected] == ["dense", "experts 0,1"], rec.rejected
    if heartbeat == "stopped":
        assert all("without a heartbeat since" in r for r in rec.rejected), rec.rejected
        assert rec.phase_seconds["checks"] < TIMING.round_s / 3, rec.phase_seconds
    else:
        assert rec.phase_seconds["checks"] > TIMING.round_s / 2, rec.phase_seconds
        assert rec.check_seconds["await"] > TIMING.round_s / 2, rec.check_seconds  # the wait is for digests


def test_downloads_run_while_the_groups_average():
    """a's dense all-reduce comes 1 s late and every download from b takes 1 s: the round takes the longer
    of the two, not their sum, and the downloads are in."""
    peers = {"a": [0, 1], "b": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("delay", peer="a", seconds=1.0), Fault("slow", peer="b", seconds=1.0)])
    result = swarm.round({p: swarm.plan(p) for p in peers})["a"]
    rec = result.record
    assert sorted(result.downloads) == [2, 3] and result.dense is not None, rec
    assert rec.phase_seconds["downloads"] < 0.5, rec.phase_seconds
    assert rec.sync_seconds < 1.6, rec.phase_seconds  # one second and a margin: not the two in a row


@pytest.mark.parametrize("after_matchmaking", [False, True])
def test_downloads_begin_with_the_round_or_once_its_groups_have_their_members(after_matchmaking):
    """c is in view but takes no part: a's groups wait out the matchmaking window for it. With
    ``downloads_after_matchmaking`` the downloads begin only then (on a narrow link they would hold up the
    matchmaking messages), otherwise at once; either way they are all in by the round's end."""
    peers = {"a": [0, 1], "b": [2, 3], "c": [2, 3]}
    swarm = Swarm(peers, sync=SyncConfig(max_rel_distance=4.0, downloads_after_matchmaking=after_matchmaking))
    swarm.view.peers["b"].step = 20  # asked first: c serves nothing
    result = swarm.round({p: swarm.plan(p) for p in ("a", "b")})["a"]
    rec = result.record
    assert sorted(result.downloads) == [2, 3] and rec.download_failures == [], rec
    formed = rec.phase_seconds["matchmaking"]
    assert formed >= TIMING.matchmaking_s - 0.05, rec.phase_seconds  # waited for c
    if after_matchmaking:
        assert rec.downloads_began_s >= formed, (rec.downloads_began_s, rec.phase_seconds)
    else:
        assert rec.downloads_began_s < formed / 2, (rec.downloads_began_s, rec.phase_seconds)


def test_a_member_whose_result_alone_differs_is_out_voted_by_the_majority():
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    swarm = Swarm(peers, faults=[Fault("partial", peer="b", round=1)])  # only b's result differs
    results = swarm.round({p: swarm.plan(p) for p in peers})
    want = torch.stack([swarm.dense[p][0] for p in peers]).mean(0)
    for p in ("a", "c"):  # the dense group of three: two agree, and their result is the mean
        assert torch.allclose(results[p].dense[1][0], want, atol=1e-6), p
        assert not any(r.startswith("dense") for r in results[p].record.rejected), results[p].record
    assert results["b"].dense is None and any(
        "dense: partial round" in r for r in results["b"].record.rejected
    )
    # experts 0-1 are averaged by a and b alone: two that differ, and no majority: both drop them
    assert results["a"].experts == {} and results["b"].experts == {}


@pytest.mark.parametrize("kind", ["drop", "nan"])
def test_a_faulty_member_makes_every_member_drop_the_round(kind):
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    # centered clipping would leave a NaN member out and apply the round (test above): the mean cannot
    sync = SyncConfig(aggregation="mean") if kind == "nan" else None
    swarm = Swarm(peers, faults=[Fault(kind, peer="b", round=1)], sync=sync)
    results = swarm.round({p: swarm.plan(p) for p in peers})
    for p in peers:
        rec = results[p].record
        assert results[p].dense is None, (p, rec)
        assert any(r.startswith("dense") for r in rec.rejected), (p, rec.rejected)
    assert results["a"].experts == {} and results["c"].dense is None
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


def _errors(results, want, peers):
    """(max error of any member's dense result, max error of the members' mean result, max spread)"""
    got = [torch.stack([results[p].dense[1][i] for p in peers]) for i in range(len(want))]
    worst = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    of_mean = max((g.mean(0) - w).abs().max().item() for g, w in zip(got, want, strict=True))
    spread = max((g.amax(0) - g.amin(0)).max().item() for g in got)
    return worst, of_mean, spread


def test_compressed_rounds_send_deltas_and_reach_the_weighted_mean_within_the_codec_error():
    peers = {"a": [0, 1], "b": [0, 1], "c": [2, 3], "d": [2, 3]}
    sync = SyncConfig(codec="int8", error_feedback=False, aggregation="mean")  # see test_round_payload
    swarm = Swarm(peers, sync=sync)
    for i, p in enumerate(peers):  # tensors large enough to be encoded (the smallest travel exactly)
        g = torch.Generator().manual_seed(i)
        swarm.dense[p] = [torch.randn(40, 50, generator=g)]
        shared = {e: [torch.randn(64, 32, generator=torch.Generator().manual_seed(e)),
                      torch.randn(32, 32, generator=torch.Generator().manual_seed(e + 10))] * 2
                  for e in range(N_EXPERTS)}  # fmt: skip
        swarm.copies[p] = {e: _near(shared[e], 100 * i + e) for e in range(N_EXPERTS)}
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 2.0 - i / 4 for e in peers[p]}} for i, p in enumerate(peers)
    }
    # no common reference yet: the weights themselves travel, within int8's error of the weighted mean
    first = swarm.round({p: swarm.plan(p, index=1, weights=weights[p]) for p in peers})
    want = _weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    step = max(t.abs().max().item() for p in peers for t in swarm.dense[p]) / 127
    assert all(first[p].record.rejected == [] for p in peers), {p: first[p].record for p in peers}
    worst, _, spread = _errors(first, want, list(peers))
    assert 0 < worst <= 2 * step and spread <= 2 * step
    assert all(swarm.ctx[p].payloads.reference_id(swarm.plan(p).groups[0][0]) for p in peers)
    # each peer trains a little from the agreed state: now only the change travels
    for i, p in enumerate(peers):
        swarm.dense[p] = [t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
                          for t in first[p].dense[1]]  # fmt: skip
        for e in peers[p]:
            swarm.copies[p][e] = [t + 0.01 for t in first[p].experts[e][1]]
    second = swarm.round({p: swarm.plan(p, index=2, weights=weights[p]) for p in peers})
    assert all(second[p].record.rejected == [] for p in peers), {p: second[p].record for p in peers}
    want = _weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    # each member's result is its reference (its last result) plus the weighted mean change, encoded: the
    # small differences the weights' round left between members stay as they were, and grow no larger
    change = _weighted_mean([(weights[p][DENSE], [swarm.dense[p][0] - first[p].dense[1][0]]) for p in peers])
    delta_step = max((swarm.dense[p][0] - first[p].dense[1][0]).abs().max().item() for p in peers) / 127
    for p in peers:
        got = second[p].dense[1][0] - first[p].dense[1][0]
        assert (got - change[0]).abs().max() <= 2 * delta_step, p
    worst2, _, spread2 = _errors(second, want, list(peers))
    assert worst2 <= worst + 2 * delta_step and spread2 <= spread + 2 * delta_step, (worst2, spread2)
    for e, holders in ((0, "ab"), (3, "cd")):
        want = _weighted_mean([(weights[p][expert_item(e)], swarm.copies[p][e]) for p in holders])
        for p in holders:
            for got, w in zip(second[p].experts[e][1], want, strict=True):
                assert torch.allclose(got, w, atol=2 * step)


def test_members_with_different_references_drop_the_round_and_take_the_common_one():
    peers = {"a": [0], "b": [1], "c": [2]}
    swarm = Swarm(peers, sync=SyncConfig(codec="int8"))
    dense = swarm.plan("a").groups[0][0]
    results = swarm.round({p: swarm.plan(p, index=1) for p in peers})
    assert all(results[p].dense for p in peers)
    agreed = swarm.ctx["a"].payloads.reference(dense)
    swarm.ctx["c"].payloads.forget("t_dense")  # as after a restart, or a round c missed
    results = swarm.round({p: swarm.plan(p, index=2) for p in peers})
    for p in peers:
        assert results[p].dense is None
        assert any("different references" in r for r in results[p].record.rejected), results[p].record
    # a and b keep theirs; c takes it from one of them (its served copy), bit for bit
    assert any("took the agreed one from" in r for r in results["c"].record.rejected)
    got = swarm.ctx["c"].payloads.reference(dense)
    theirs = [swarm.ctx[q].payloads.reference(dense)[1]["dense"][0] for q in "ab"]
    assert got[0] == agreed[0] and any(torch.equal(got[1]["dense"][0], t) for t in theirs)
    # so the next round sends changes again, and is clean
    results = swarm.round({p: swarm.plan(p, index=3) for p in peers})
    assert all(results[p].record.rejected == [] and results[p].dense for p in peers), {
        p: results[p].record.rejected for p in peers
    }
    ids = {swarm.ctx[p].payloads.reference_id(dense) for p in peers}
    assert len(ids) == 1 and ids != {agreed[0]} and "" not in ids


def test_with_a_lossy_codec_a_copy_is_refreshed_from_the_change_against_it():
    peers = {"a": [0, 1], "b": [2, 3]}
    swarm = Swarm(peers, sync=SyncConfig(codec="int8"))
    for p in peers:  # large enough to be encoded, and fp16 values like copies that came off the wire
        # values below 4, where fp16's rounding stays under the tolerance of the checks below
        shared = {e: [0.5 * torch.randn(64, 32, generator=torch.Generator().manual_seed(e))] * 2
                  for e in range(N_EXPERTS)}  # fmt: skip
        swarm.copies[p] = {e: [t.half().float() for t in _near(shared[e], ord(p) + e, scale=0.1)]
                           for e in range(N_EXPERTS)}  # fmt: skip
    # rounds at advancing steps, as in a run: a holder's copy from an earlier round is no fresh copy (with
    # one step for every round, a download could take the holder's previous copy before its round began)
    first = swarm.round({p: swarm.plan(p, index=1) for p in peers})
    for p in peers:
        for e, ts in first[p].downloads.items():  # the training thread applies what came
            swarm.copies[p][e] = [t.float() for t in ts]
    assert sorted(first["a"].downloads) == [2, 3]
    whole = [f for f in swarm.net.fetched if f[:3] == ("a", "b", "t_experts") and f[3] > 0]
    # b trains its experts: a gets b's change against the copy a holds, encoded, and rebuilds b's new copy
    for e in peers["b"]:
        swarm.copies["b"][e] = [t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(e))
                                for t in swarm.copies["b"][e]]  # fmt: skip
    # a round that is not a refresh round (sync.refresh_every): nothing downloaded, the holder's served copy
    # stays the one a holds, so the next refresh is still a change against it
    swarm.at_step(20)
    between = swarm.round({p: swarm.plan(p, index=2, refresh=False, step=20) for p in peers})
    assert between["a"].downloads == {} and "downloads" not in between["a"].record.phase_seconds
    for e in peers["b"]:
        swarm.copies["b"][e] = [t + 0.005 for t in swarm.copies["b"][e]]
    swarm.at_step(30)
    second = swarm.round({p: swarm.plan(p, index=3, step=30) for p in peers})
    assert second["a"].record.download_failures == [] and sorted(second["a"].downloads) == [2, 3]
    assert [
        f for f in swarm.net.fetched if f[:3] == ("a", "b", "t_experts") and f[3] > 0
    ] == whole  # no whole copy again
    assert any(f[:3] == ("a", "b", "t_expert_deltas") and f[3] > 0 for f in swarm.net.fetched)
    # int8 changes instead of fp16 copies: about half the bytes for the downloads
    got_first = first["a"].record.bytes_recv - first["a"].record.bytes_sent
    got_second = second["a"].record.bytes_recv - second["a"].record.bytes_sent
    assert 0.45 * got_first < got_second < 0.6 * got_first, (got_first, got_second)
    for e in peers["b"]:
        for got, want in zip(second["a"].downloads[e], swarm.copies["b"][e], strict=True):
            change_step = 0.06 / 127  # |change| stays below 0.06 here
            assert got.dtype == torch.float16 and (got.float() - want).abs().max() <= change_step + 1e-3
    # a copy that is not the one the change was made against gets a whole copy instead
    swarm.copies["a"][2] = [t + 0.1 for t in swarm.copies["a"][2]]
    swarm.at_step(40)
    third = swarm.round({p: swarm.plan(p, index=4, step=40) for p in peers})
    assert sorted(third["a"].downloads) == [2, 3]
    assert len([f for f in swarm.net.fetched if f[:3] == ("a", "b", "t_experts") and f[3] > 0]) > len(whole)
    # a holder that serves malformed metadata (copies and changes) gives nothing, and crashes nobody
    swarm.net.faults = [Fault("garble", peer="b")]
    mine = {e: swarm.copies["a"][e] for e in (2, 3)}
    got, _, failures = swarm.ctx["a"].downloads.fetch({2: [("b", 10)], 3: [("b", 10)]}, mine, 10, False,
                                                      time.monotonic() + 0.8)  # fmt: skip
    assert got == {} and failures
