"""The round's protocol rules, in process, on the fault-injecting ``LocalNetwork`` (seconds, no sockets)."""

import dataclasses
import time

import pytest
import torch

from swarm.config import SyncConfig
from swarm.net.group_layout import DENSE, core_spec, dense_spec, expert_item, layout
from swarm.net.local_transport import Fault
from swarm.net.round_payload import rebased_id
from tests.local_swarm import N_EXPERTS, TIMING, Swarm, near_copy, weighted_mean

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("r", [2, 4])
def test_replicated_experts_average_to_the_exact_weighted_mean(r):
    peers = ["a", "b", "c", "d"]
    experts = {p: [e for e in range(N_EXPERTS) if (e - i) % (4 // r) == 0] for i, p in enumerate(peers)}
    swarm = Swarm(experts, sync=SyncConfig(aggregation="mean", codec="fp32"))
    began = time.time()
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 0.5 + e + i for e in experts[p]}} for i, p in enumerate(peers)
    }
    results = swarm.round({p: swarm.plan(p, weights=weights[p]) for p in peers})
    want_dense = weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    for p in peers:
        rec = results[p].record
        assert rec.rejected == [] and rec.dense_group == 4, rec
        # started_at is rounded to the millisecond: it may read up to half of one before ``began``
        assert began - 0.001 <= rec.started_at <= rec.started_at + rec.sync_seconds <= time.time() + 0.01
        phases = rec.phase_seconds  # where the time went, adding up to the round's
        assert list(phases) == ["matchmaking", "allreduce", "checks", "downloads", "merge"], phases
        assert abs(sum(phases.values()) - rec.sync_seconds) < 0.01 and min(phases.values()) >= 0
        assert 0 <= rec.startup_s <= rec.sync_seconds, rec.startup_s
        parts = rec.startup_seconds  # the start-up's parts, within it
        assert sorted(parts) == ["encode", "residuals", "serve", "start"] and min(parts.values()) >= 0, parts
        assert sum(parts.values()) <= rec.startup_s + 0.005, (parts, rec.startup_s)
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
            want = weighted_mean([(weights[q][expert_item(e)], swarm.copies[q][e]) for q in holders])
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
    swarm = Swarm(
        peers,
        sync=SyncConfig(max_rel_distance=4.0, codec="fp32", downloads_after_matchmaking=after_matchmaking),
    )
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
    assert rec.downloads_began_s <= rec.downloads_ended_s <= rec.sync_seconds and rec.downloads_waited_s >= 0


@pytest.mark.parametrize("lagged", [False, True])
def test_a_lagged_refresh_downloads_the_copies_agreed_the_round_before_without_waiting_for_the_groups(lagged):
    """b and c average experts 2 and 3, and their outcomes come 1 s late. Refreshed as usual, a's copies
    are those of this round, once b's and c's groups are done. With ``sync.lagged_refresh`` a round brings
    those its holders agreed the round before, at once; the first brings none (none agreed yet), and does
    not wait past our groups for them."""
    peers = {"a": [0, 1], "b": [2, 3], "c": [2, 3]}
    sync = SyncConfig(max_rel_distance=4.0, codec="fp32", lagged_refresh=lagged)
    # room for a loaded machine: twice in suite runs, c's round thread began its groups more than the 0.3 s
    # matchmaking window after b's (each then alone in its expert group); complete groups begin at once
    timing = dataclasses.replace(TIMING, matchmaking_s=1.0, round_s=6.0)
    faults = [Fault("delay", peer=p, seconds=1.0) for p in "bc"]
    swarm = Swarm(peers, sync=sync, faults=faults, timing=timing)
    for p, local in peers.items():  # as a peer starts: its initial copies served, as of step 0
        swarm.ctx[p].server.update({expert_item(e): swarm.copies[p][e] for e in local}, 0, False)
    held = {e: 0 for e in range(N_EXPERTS)}
    first = swarm.round({p: swarm.plan(p, copy_steps=held) for p in peers})
    rec = first["a"].record
    assert rec.download_failures == [] and rec.downloads_ended_s <= rec.sync_seconds, rec
    assert all(sorted(first[p].experts) == [2, 3] for p in "bc"), {p: first[p].record for p in "bc"}
    agreed = {e: first["b"].experts[e][1] for e in (2, 3)}
    if not lagged:
        assert sorted(first["a"].downloads) == [2, 3] and rec.downloads_ended_s >= 1.0, rec
        got, steps = first["a"].downloads, first["a"].download_steps
    else:
        assert first["a"].downloads == {}, rec  # b and c serve their initial copies: no newer than ours
        swarm.at_step(20)
        second = swarm.round({p: swarm.plan(p, index=2, step=20, copy_steps=held) for p in peers})
        rec = second["a"].record
        assert sorted(second["a"].downloads) == [2, 3] and rec.download_failures == [], rec
        assert rec.downloads_ended_s < 0.5 and rec.sync_seconds >= 1.0, rec  # not behind the groups
        got, steps = second["a"].downloads, second["a"].download_steps
    assert steps == {2: 10, 3: 10}
    for e in (2, 3):
        for t, want in zip(got[e], agreed[e], strict=True):
            assert t.dtype == torch.float16 and torch.allclose(t.float(), want, atol=2e-3 * want.abs().max())


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
    # int8 for the dense weights too (see test_round_payload for error feedback)
    sync = SyncConfig(codec="int8", dense_codec="int8", error_feedback=False, aggregation="mean")
    swarm = Swarm(peers, sync=sync)
    for i, p in enumerate(peers):  # tensors large enough to be encoded (the smallest travel exactly)
        g = torch.Generator().manual_seed(i)
        swarm.dense[p] = [torch.randn(40, 50, generator=g)]
        shared = {e: [torch.randn(64, 32, generator=torch.Generator().manual_seed(e)),
                      torch.randn(32, 32, generator=torch.Generator().manual_seed(e + 10))] * 2
                  for e in range(N_EXPERTS)}  # fmt: skip
        swarm.copies[p] = {e: near_copy(shared[e], 100 * i + e) for e in range(N_EXPERTS)}
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 2.0 - i / 4 for e in peers[p]}} for i, p in enumerate(peers)
    }
    # no common reference yet: the weights themselves travel, within int8's error of the weighted mean
    first = swarm.round({p: swarm.plan(p, index=1, weights=weights[p]) for p in peers})
    want = weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
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
    want = weighted_mean([(weights[p][DENSE], swarm.dense[p]) for p in peers])
    # each member's result is its reference (its last result) plus the weighted mean change, encoded: the
    # small differences the weights' round left between members stay as they were, and grow no larger
    change = weighted_mean([(weights[p][DENSE], [swarm.dense[p][0] - first[p].dense[1][0]]) for p in peers])
    delta_step = max((swarm.dense[p][0] - first[p].dense[1][0]).abs().max().item() for p in peers) / 127
    for p in peers:
        got = second[p].dense[1][0] - first[p].dense[1][0]
        assert (got - change[0]).abs().max() <= 2 * delta_step, p
    worst2, _, spread2 = _errors(second, want, list(peers))
    assert worst2 <= worst + 2 * delta_step and spread2 <= spread + 2 * delta_step, (worst2, spread2)
    for e, holders in ((0, "ab"), (3, "cd")):
        want = weighted_mean([(weights[p][expert_item(e)], swarm.copies[p][e]) for p in holders])
        for p in holders:
            for got, w in zip(second[p].experts[e][1], want, strict=True):
                assert torch.allclose(got, w, atol=2 * step)


def test_the_dense_group_may_travel_in_a_codec_of_its_own():
    """``sync.dense_codec: int4`` with ``sync.codec: int8``: the dense all-reduce in 4 bits, expert groups in
    8, each within its codec's error, and the round's bytes counted by each group's codec."""
    peers = {"a": [0, 1], "b": [0, 1]}
    sync = SyncConfig(codec="int8", dense_codec="int4", error_feedback=False, aggregation="mean")
    swarm = Swarm(peers, sync=sync)
    for i, p in enumerate(peers):  # tensors large enough to be encoded (the smallest travel exactly)
        swarm.dense[p] = [torch.randn(40, 50, generator=torch.Generator().manual_seed(i))]
        swarm.copies[p] = {e: [torch.randn(64, 32, generator=torch.Generator().manual_seed(10 * i + e))] * 4
                           for e in range(N_EXPERTS)}  # fmt: skip
    results = swarm.round({p: swarm.plan(p, refresh=False) for p in peers})
    assert all(results[p].record.rejected == [] for p in peers), {p: results[p].record for p in peers}
    dense = weighted_mean([(1.0, swarm.dense[p]) for p in peers])[0]
    absmax = max(swarm.dense[p][0].abs().max().item() for p in peers)
    errors = [(results[p].dense[1][0] - dense).abs().max().item() for p in peers]
    assert 2 * absmax / 127 < max(errors) <= 2 * absmax / 7, errors  # int4's steps, not int8's
    for e in (0, 1):
        want = weighted_mean([(1.0, swarm.copies[p][e]) for p in peers])[0]
        step = max(swarm.copies[p][e][0].abs().max().item() for p in peers) / 127
        for p in peers:
            assert (results[p].experts[e][1][0] - want).abs().max() <= 2 * step
    int4, int8 = (swarm.ctx["a"].payloads.codec_for(spec) for spec, _ in swarm.plan("a").groups)
    assert (int4.name, int8.name) == ("int4", "int8")
    # a pair's butterfly: each group's payload out, half in reduce-scatter and half in all-gather
    want = int4.wire_bytes(2000) + 8 * int8.wire_bytes(2048)  # two experts of four tensors
    assert [results[p].record.bytes_sent for p in peers] == [want, want]


def test_a_core_round_averages_the_core_dense_weights_in_a_group_of_their_own():
    """``sync.embeddings_every``: between full dense rounds a round averages only the core dense weights (here
    the second of two tensors), in a dense-codec group of every peer, to their exact mean. Each dense group's
    result is the other's reference for the core weights, so that each round's changes of them span one
    round, and members that applied the same rounds name their references alike."""
    peers = {"a": [0], "b": [1], "c": [2]}
    sync = SyncConfig(codec="int8", dense_codec="int8", error_feedback=False, aggregation="mean")
    swarm = Swarm(peers, sync=sync)
    for i, p in enumerate(peers):  # the "embeddings" first, the core after; large enough to be encoded
        g = torch.Generator().manual_seed(i)
        swarm.dense[p] = [torch.randn(60, 50, generator=g), torch.randn(20, 50, generator=g)]
        swarm.ctx[p] = dataclasses.replace(swarm.ctx[p], core=(1,))  # as SwarmSync sets it
    plans = {p: swarm.plan(p, index=1, refresh=False, full=False) for p in peers}
    assert [spec for spec, _ in plans["a"].groups][0] == core_spec("t")
    core = swarm.round(plans)
    want = weighted_mean([(1.0, swarm.dense[p][1:]) for p in peers])[0]
    step = max(swarm.dense[p][1].abs().max().item() for p in peers) / 127
    for p in peers:
        rec = core[p].record
        assert rec.rejected == [] and rec.dense_group == 3 and core[p].dense is None, rec
        assert core[p].core[0][0] is swarm.dense[p][1] and (core[p].core[1][0] - want).abs().max() <= step
        assert rec.bytes_sent == int(2 * sync_codec(swarm, p).wire_bytes(1000) * 2 / 3)  # the core alone
    payloads = {p: swarm.ctx[p].payloads for p in peers}

    def refs(p: str) -> tuple:
        return tuple(payloads[p].reference(spec) for spec in (dense_spec("t"), core_spec("t")))

    assert all(refs(p)[0] == ("", None) and refs(p)[1][0] for p in peers)  # no full round yet
    full = swarm.round({p: swarm.plan(p, index=2, refresh=False) for p in peers})
    for p in peers:
        assert full[p].record.rejected == [] and full[p].core is None and len(full[p].dense[1]) == 2
        (dense_id, dense), (core_id, core_ref) = refs(p)
        assert core_id == dense_id == refs("a")[0][0]  # named by the full round, on every member
        assert torch.equal(core_ref["core"][0], full[p].dense[1][1])
    full_ids = {p: refs(p)[0][0] for p in peers}
    again = swarm.round({p: swarm.plan(p, index=3, refresh=False, full=False) for p in peers})
    for p in peers:
        assert again[p].record.rejected == [], again[p].record
        (dense_id, dense), (core_id, _) = refs(p)
        # the dense reference: the full round's embeddings, this core round's core weights, named by both
        assert dense_id == rebased_id(full_ids[p], core_id) and core_id != full_ids[p], (dense_id, core_id)
        assert torch.equal(dense["dense"][0], full[p].dense[1][0])
        assert torch.equal(dense["dense"][1], again[p].core[1][0])
    assert len({refs(p)[0][0] for p in peers}) == 1
    # the next full round sends changes against that reference, and every member holds it alike
    last = swarm.round({p: swarm.plan(p, index=4, refresh=False) for p in peers})
    want = weighted_mean([(1.0, swarm.dense[p]) for p in peers])
    for p in peers:
        assert last[p].record.rejected == [], last[p].record
        for got, w in zip(last[p].dense[1], want, strict=True):
            assert (got - w).abs().max() <= 2 * max(t.abs().max().item() for t in swarm.dense[p]) / 127


def sync_codec(swarm: Swarm, p: str):
    return swarm.ctx[p].payloads.codec_for(core_spec("t"))


def test_with_a_lossy_codec_a_copy_is_refreshed_from_the_change_against_it():
    peers = {"a": [0, 1], "b": [2, 3]}
    swarm = Swarm(peers, sync=SyncConfig(codec="int8"))
    for p in peers:  # large enough to be encoded, and fp16 values like copies that came off the wire
        # values below 4, where fp16's rounding stays under the tolerance of the checks below
        shared = {e: [0.5 * torch.randn(64, 32, generator=torch.Generator().manual_seed(e))] * 2
                  for e in range(N_EXPERTS)}  # fmt: skip
        swarm.copies[p] = {e: [t.half().float() for t in near_copy(shared[e], ord(p) + e, scale=0.1)]
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


def test_groups_met_before_the_slot_average_to_the_exact_weighted_mean_once_triggered():
    """``sync.prematch_s``: members meet while training goes on, and each writes its payload at the slot.
    A member that met early but starts no round is left out: the others average without it."""
    import dataclasses

    from swarm.net.prematch import Prematch

    peers = ["a", "b", "c", "d"]
    experts = {p: [e for e in range(N_EXPERTS) if (e - i) % 2 == 0] for i, p in enumerate(peers)}
    swarm = Swarm(experts, sync=SyncConfig(aggregation="mean", codec="int8"))
    weights = {
        p: {DENSE: 1.0 + i, **{expert_item(e): 0.5 + e + i for e in experts[p]}} for i, p in enumerate(peers)
    }
    plans = {p: swarm.plan(p, weights=weights[p]) for p in peers}
    slot = time.time() + 0.5
    early = {
        p: Prematch.begin(
            swarm.ctx[p], swarm.view, 1, 1, 9, plans[p].weights, (0, None), plans[p].groups, False, slot
        )
        for p in peers
    }
    assert all(set(early[p].handles) == {spec.name for spec, _ in plans[p].groups} for p in peers)
    early["d"].cancel()  # d's round does not start at this slot
    time.sleep(max(0.0, slot - time.time()))
    plans = {p: dataclasses.replace(plans[p], prematched=early[p].handles) for p in "abc"}
    results = swarm.round(plans)
    for p in "abc":
        rec = results[p].record
        # b's expert group had b and d: d never gave its payload, so b's experts were not averaged
        alone = ["experts 1,3: no group formed"] if p == "b" else []
        assert rec.rejected == alone and rec.dense_group == 3, rec
        assert sorted(rec.met_early) == sorted(["dense", "experts 1,3" if p == "b" else "experts 0,2"]), rec
        assert rec.phase_seconds["matchmaking"] < 0.05, rec.phase_seconds  # met before the round began
    want = weighted_mean(
        [(weights[p][DENSE], swarm.dense[p]) for p in "abc"]
    )  # with the weights they met with
    for p in "abc":
        for got, w in zip(results[p].dense[1], want, strict=True):
            assert torch.allclose(got, w, atol=1e-6), p
