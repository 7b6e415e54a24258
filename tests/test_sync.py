"""The SPES rules without a network: claims, applying an average, merge warm-up, tensor checks."""

import math

import pytest
import torch

from swarm.sync import (
    OuterStep,
    RejectedTensor,
    check_tensor,
    choose_experts,
    clamp_weight,
    merge_alpha_at,
    merge_experts,
    orphan_claim_rank,
    orphan_swap,
    settle_joiners,
    should_merge,
)


def test_claims_fill_coverage_before_replication():
    holders: dict[int, set[str]] = {}
    for peer in ["a", "b", "c", "d"]:
        mine = choose_experts(holders, 16, 4, peer)
        for e in mine:
            holders.setdefault(e, set()).add(peer)
    assert sorted(holders) == list(range(16)) and all(len(h) == 1 for h in holders.values())
    fifth = choose_experts(holders, 16, 4, "e")  # everything covered once: a whole peer's set, so that
    assert fifth == choose_experts(holders, 16, 4, "e") and len(set(fifth)) == 4  # co-holders stay aligned
    assert len({frozenset(holders[e]) for e in fifth}) == 1


def test_joiners_replicate_in_aligned_sets():
    claims = settle_joiners({e: set() for e in range(16)}, ["pa", "pb", "pc", "pd"], 16, 8)
    sets = sorted({tuple(c) for c in claims.values()})
    assert len(sets) == 2 and sorted(sets[0] + sets[1]) == list(range(16))  # r = 2: two aligned pairs


def test_claims_ignore_own_records_and_prefer_uncovered():
    holders = {0: {"x", "y"}, 1: {"x"}, 2: {"me"}}
    assert choose_experts(holders, 4, 2, "me") == [2, 3]


def test_orphan_swap_only_when_all_mine_are_replicated():
    holders = {0: {"me", "b"}, 1: {"me", "c"}, 2: set()}
    assert orphan_swap([0, 1], holders, {2: 100.0}, grace_s=60, peer_id="me") in {(0, 2), (1, 2)}
    assert orphan_swap([0, 1], holders, {2: 10.0}, grace_s=60, peer_id="me") is None  # grace not over
    holders[1] = {"me"}
    assert orphan_swap([0, 1], holders, {2: 100.0}, grace_s=60, peer_id="me") is None  # 1 would be orphaned


def test_peers_that_see_the_same_orphans_go_for_the_same_one_and_one_is_first():
    """A holder of 4 orphans leaves; two peers holding the same 4 experts both see 4 orphans of one age."""
    for a, b in [("p0", "p2"), ("alice", "bob"), ("x1", "x2"), ("12D3KooWa", "12D3KooWb")]:
        holders = {e: {a, b} for e in range(4)} | {e: set() for e in range(4, 8)}
        ages = {e: 100.0 for e in range(4, 8)}
        swaps = {p: orphan_swap(list(range(4)), holders, ages, grace_s=60, peer_id=p) for p in (a, b)}
        assert swaps[a][1] == swaps[b][1] == 4, swaps  # the longest orphaned, then the lowest id
        ranks = sorted(orphan_claim_rank(4, holders, p) for p in (a, b))
        assert ranks == [0, 1]  # one claims now, the other a heartbeat later sees it is no longer eligible


def test_apply_average_keeps_local_progress():
    snap = {"w": torch.tensor([1.0, 2.0])}
    avg = {"w": torch.tensor([3.0, 0.0])}
    params = {"w": torch.tensor([1.5, 2.5])}  # moved by local steps taken during the round
    OuterStep(alpha=1.0).apply(params, snap, avg)
    assert torch.allclose(params["w"], torch.tensor([3.5, 0.5]))
    params = {"w": torch.tensor([1.0, 2.0])}
    OuterStep(alpha=0.5).apply(params, snap, avg)
    assert torch.allclose(params["w"], torch.tensor([2.0, 1.0]))


def test_plain_averaging_keeps_no_state_between_rounds():
    step = OuterStep()
    p = {"w": torch.zeros(2)}
    step.apply(p, {"w": torch.zeros(2)}, {"w": torch.ones(2)})
    assert step.plain and not step.anchors and not step.buffers and torch.equal(p["w"], torch.ones(2))


def test_the_outer_step_is_nesterov_sgd_on_the_swarms_progress_since_the_last_agreed_weights():
    """DiLoCo: g = anchor - average, m = mu m + g, anchor -= alpha (g + mu m); the live weights keep the steps
    taken since the snapshot. Hand-computed with alpha 0.5, mu 0.5."""
    step = OuterStep(alpha=0.5, momentum=0.5)
    p = {"w": torch.tensor([1.0])}
    # round 1: the anchor is the first snapshot (1); the swarm's average is 3: g = -2, m = -2, update -3
    step.apply(p, {"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])})
    assert p["w"].item() == pytest.approx(2.5)  # anchor 1 + 0.5 * 3
    # local steps move us to 3.5; round 2 averages to 4.5 and we took 0.25 more steps meanwhile:
    # g = 2.5 - 4.5 = -2, m = -1 - 2 = -3, update = -2 - 1.5 = -3.5, anchor = 2.5 + 1.75 = 4.25
    p["w"] += 1.25
    step.apply(p, {"w": torch.tensor([3.5])}, {"w": torch.tensor([4.5])})
    assert step.anchors["w"].item() == pytest.approx(4.25)
    assert p["w"].item() == pytest.approx(4.25 + 0.25)


def test_a_sole_holders_step_acts_on_its_own_progress_and_a_dropped_round_is_covered_by_the_next():
    step = OuterStep(alpha=1.0, momentum=0.5)
    p = {"e": torch.tensor([0.0])}
    step.apply(p, {"e": torch.tensor([0.0])}, {"e": torch.tensor([0.0])})  # nothing to average: a = s
    assert p["e"].item() == 0.0
    p["e"] += 2.0  # two rounds of local progress, the first of them dropped (never applied)
    step.apply(p, {"e": p["e"].clone()}, {"e": p["e"].clone()})  # g = -2, m = -2, update = -3
    assert p["e"].item() == pytest.approx(3.0)
    step.keep({"dense"})  # the expert was given up: its state goes
    assert not step.anchors and not step.buffers


def test_merge_matches_direct_formula():
    torch.manual_seed(0)
    e, i, h, topk, alpha = 6, 4, 8, 2, 0.3
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    local = [1, 4]
    gu, dn = merge_experts(gate_up, down, local, alpha, topk)
    for row, x in enumerate(local):
        sims = []
        for j in range(e):
            if j != x:
                a, b = gate_up[x, :i].flatten(), gate_up[j, :i].flatten()
                sims.append((float(a @ b / (a.norm() * b.norm())), j))
        nbrs = [j for _, j in sorted(sims, reverse=True)[:topk]]
        want_gu = gate_up[x] + alpha * sum(gate_up[j] - gate_up[x] for j in nbrs) / topk
        want_dn = down[x] + alpha * sum(down[j] - down[x] for j in nbrs) / topk
        assert torch.allclose(gu[row], want_gu, atol=1e-6) and torch.allclose(dn[row], want_dn, atol=1e-6)


def test_merge_picks_neighbours_by_direction_and_survives_an_all_zero_expert():
    torch.manual_seed(1)
    e, i, h = 5, 4, 8
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    gate_up[3] = -7.0 * gate_up[0]  # opposite direction: the least similar, whatever its norm
    gate_up[2, :i] = 40.0 * gate_up[0, :i] + 0.01 * torch.randn(i, h)  # expert 0's direction, far larger
    gate_up[4] = 0.0  # zero gates: cosine 0 with everything, no NaN
    gu, dn = merge_experts(gate_up, down, [0, 4], 0.5, 1)
    assert torch.allclose(gu[0], gate_up[0] + 0.5 * (gate_up[2] - gate_up[0]))
    assert torch.allclose(dn[0], down[0] + 0.5 * (down[2] - down[0]))
    assert torch.isfinite(gu).all() and torch.isfinite(dn).all()


def test_merge_schedule():
    assert merge_alpha_at(0, 0.5, 100) == 0.5
    assert merge_alpha_at(50, 0.5, 100) == pytest.approx(0.25)
    assert merge_alpha_at(100, 0.5, 100) == 0.0 and merge_alpha_at(10, 0.5, 0) == 0.0
    assert (
        should_merge(10, 4, 100, 2) and not should_merge(10, 3, 100, 2) and not should_merge(100, 4, 100, 2)
    )


def test_tensor_checks():
    local = torch.ones(4)
    check_tensor("w", local * 1.1, local, max_rel_distance=0.5)
    for bad, why in [
        (torch.ones(5), "shape"),
        (torch.tensor([1.0, math.nan, 1, 1]), "NaN"),
        (torch.full((4,), 1e30), "distance"),
        (torch.ones(4, dtype=torch.long), "dtype"),
    ]:
        with pytest.raises(RejectedTensor, match=why):
            check_tensor("w", bad, local, max_rel_distance=0.5)
    assert clamp_weight(1e9, 1e6) == 1e6 and clamp_weight(-3, 10) == 0 and clamp_weight(math.nan, 10) == 0


def test_a_copy_comparison_decides_and_measures_as_the_separate_checks_do():
    """``CopyComparison`` (one pass per sum, for downloaded copies) against ``check_tensors``,
    ``relative_change`` and ``copy_doubt`` on the same copies: the same verdicts, messages and numbers."""
    from swarm.sync import CopyComparison, check_tensors, relative_change
    from swarm.sync.copy_prints import copy_doubt, norm_doubt

    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(64, 32, generator=gen).to(torch.bfloat16), torch.randn(100, generator=gen)]
    moved = [(t.float() + 0.05 * torch.randn(t.shape, generator=gen)).half() for t in ours]
    copies = {
        "moved": moved,
        "negated": [-t for t in moved],
        "zeroed": [torch.zeros_like(t) for t in moved],
        "scaled": [3 * t for t in moved],
        "far": [t + 100 for t in moved],
        "nan": [moved[0], torch.full((100,), math.nan, dtype=torch.float16)],
        "inf": [moved[0], torch.full((100,), math.inf)],
        "overflowing": [moved[0], torch.full((100,), 1e30)],  # finite values whose squares overflow
        "shape": [moved[0], torch.zeros(99)],
        "dtype": [moved[0], torch.zeros(100, dtype=torch.long)],
        "count": moved[:1],
    }
    for label, copy in copies.items():
        try:
            check_tensors("expert3", copy, ours, 4.0)
            want = ""
        except RejectedTensor as e:
            want = str(e)
        try:
            compared = CopyComparison.of("expert3", copy, ours)
            compared.check(4.0)
            got = ""
        except RejectedTensor as e:
            got = str(e)
        assert got == want, label
        if want:
            continue
        assert compared.relative_change == pytest.approx(relative_change(copy, ours), rel=1e-5), label
        doubt = norm_doubt(compared.received_norm, compared.norm, compared.dot)
        assert doubt == copy_doubt(copy, ours), label
        assert bool(doubt) == (label != "moved"), label


def test_an_outlying_change_is_one_far_above_the_fetchs_median_and_above_the_copys_own_norm():
    from swarm.sync import outlying_changes

    honest = {e: 0.15 + 0.01 * e for e in range(11)} | {11: 0.8}  # an expert that moved fast, early on
    assert outlying_changes(honest)[0] == set()
    random_copy = honest | {12: 1.41}  # a copy replaced by another of the same norm
    outliers, median = outlying_changes(random_copy)
    assert outliers == {12} and abs(median - 0.21) < 1e-9
    assert outlying_changes({0: 0.1, 1: 5.0})[0] == set()  # two copies: no majority to judge by
