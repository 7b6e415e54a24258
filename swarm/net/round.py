"""One synchronisation round, as a function of what it needs: ``run_round(plan, ctx, view) -> RoundResult``.

    plan = RoundPlan(index=3, step=300, dense=snapshot, experts={0: [...]}, frozen={5: [...]},
                     weights={"dense": 1.0, "expert0": 0.9}, groups=[(spec, group), ...], sole=[0])
    result = run_round(plan, ctx, members.view)    # never takes longer than timing.round_s (+ a last
    result.record.rejected                         # round's wait for its shared start); failures listed

The dense weights (between full rounds with ``sync.embeddings_every``, the core ones: ``ctx.core``) are
averaged across the peers that show up and each group of local experts with the same holders among those
holders (``group_layout``): with ``sync.aggregation: mean`` every item weighted by
its tokens; with a robust rule every member equally, each one's pull bounded (``robust_mean``, reduced
inside hivemind's all-reduce: ``ruled_allreduce``). Every outcome is
verified before it is used (``round_checks``): each member's round info is well formed and of the same kind (last or
ordinary), the weights that came back are the mean of those the members claimed, all members ended with
the same tensors (``round_consensus``), and each tensor passes ``check_tensors``. Meanwhile non-local
experts are downloaded from their holders (``round_downloads``; not in a last round: ``last_round``
fetches the settled copies); then the merge warm-up runs (``round_merge``). Nothing here touches the model: the
training thread applies the result (theta <- theta + alpha * (a - s)).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from swarm.config import RunConfig, SyncConfig
from swarm.net.dense_reference import catch_up_reference, take_reference
from swarm.net.expert_download import ExpertDownloads
from swarm.net.expert_server import ExpertServer
from swarm.net.expert_tensors import nbytes
from swarm.net.group_layout import (
    CORE,
    DENSE,
    GroupSpec,
    OpenGroups,
    dense_group_names,
    expected_members,
    expert_item,
    is_dense,
    pack,
)
from swarm.net.membership import MembershipView
from swarm.net.prematch import Prematched, leave
from swarm.net.round_checks import add_time, check_outcome, confirm_outcome, our_info, weighted
from swarm.net.round_consensus import StoreDigests
from swarm.net.round_downloads import Gate, RoundDownloads, stopped_training
from swarm.net.round_info import REFERENCES_DIFFER
from swarm.net.round_merge import merge_round
from swarm.net.round_payload import Payloads
from swarm.net.round_phases import Phases
from swarm.net.served_prints import served_prints
from swarm.net.timing import MIN_LOOK_S, Timing
from swarm.net.transport import DigestExchange, Group, GroupOutcome, GroupTransport, Store
from swarm.train.round_record import RoundRecord


@dataclass(frozen=True)
class RoundPlan:
    index: int
    step: int
    dense: list[torch.Tensor]  # host fp32 snapshot
    experts: Mapping[int, list[torch.Tensor]]  # local experts' snapshots
    frozen: Mapping[int, list[torch.Tensor]]  # non-local experts, read in place (nothing writes them now)
    weights: Mapping[str, float]  # item -> tokens since the last round, in sync intervals' worth
    groups: Sequence[tuple[GroupSpec, Group]]  # the layout's groups, opened by the caller (main thread)
    sole: Sequence[int]  # local experts nobody else holds: only served
    scheduled: float | None = None  # the last round's shared start (wall time)
    last: bool = False
    # no partner in view (MembershipView.partners): the dense group is not started (its matchmaking window
    # would be spent for nothing), it only serves our copy, which a joiner catches up from
    alone: bool = False
    # a refresh round (every ``sync.refresh_every``-th sync point of the swarm, the same on every peer):
    # holders advance the copies they serve and downloaders fetch them only then, so a downloader's copy is
    # the one the holder's next change is taken against
    refresh: bool = True
    copy_steps: Mapping[int, int] = field(default_factory=dict)  # the step of each non-local copy we hold
    # group name -> its members met before the slot (``swarm.net.prematch``): triggered, not started
    prematched: Mapping[str, Prematched] = field(default_factory=dict)
    # an ordinary round's wall-clock slot (``sync.sync_every_s``), whose end bounds its matchmaking
    slot: int | None = None
    # wall time: an ordinary round near a shared stop looks for members until then at most
    look_until: float | None = None


@dataclass
class RoundResult:
    record: RoundRecord
    dense: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (snapshot, average)
    core: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # the core dense weights', the same
    experts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    downloads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    download_steps: dict[int, int] = field(default_factory=dict)  # the step each download is from


@dataclass(frozen=True)
class RoundContext:
    """What stays the same from round to round."""

    run_id: str
    me: str
    store: Store
    timing: Timing
    sync: SyncConfig
    n_experts: int
    groups: OpenGroups  # opened on the main thread: hivemind sets signal handlers when it starts one
    server: ExpertServer
    downloads: ExpertDownloads
    payloads: Payloads | None = None  # None: built from ``sync`` (the codec and its error feedback)
    digests: DigestExchange | None = None  # None: through ``store`` (``StoreDigests``)
    # the swarm as the heartbeat thread sees it now (None: only the view a round starts with), so that a
    # round waiting for a member's digest can tell a member that died from one that is slow
    view_now: Callable[[], MembershipView] | None = None
    # where the core dense weights are in the dense ones (``expert_tensors.core_index``) when the swarm averages
    # them on their own (``sync.embeddings_every`` > 1): what a core group averages, and each dense group's
    # result is the other's reference for them
    core: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.payloads is None:
            object.__setattr__(self, "payloads", Payloads.for_sync(self.sync))
        if self.digests is None:
            object.__setattr__(self, "digests", StoreDigests(self.store, self.me))

    @classmethod
    def build(cls, cfg: RunConfig, store: Store, transport: GroupTransport, timing: Timing) -> RoundContext:
        """A peer's: its expert server (and, with a lossy codec, the server of its experts' changes), its
        downloads, groups and payloads."""
        payloads, name = Payloads.for_sync(cfg.sync), f"{cfg.run_id}_experts"
        codec = payloads.codec  # the experts': their groups', and their copies' changes
        deltas = None if codec.lossless else transport.open_server(f"{cfg.run_id}_expert_deltas", codec)
        server = ExpertServer(transport.open_server(name), deltas, codec)
        changes = (deltas.name, codec) if deltas else None
        digests = transport.direct_digests() if cfg.sync.digests == "direct" else None  # None: the store
        downloads = ExpertDownloads(
            transport, name, timing.download_s, cfg.sync.max_rel_distance, changes, cfg.train.lr
        )
        return cls(
            cfg.run_id, transport.me, store, timing, cfg.sync, cfg.model.n_experts, OpenGroups(transport),
            server, downloads, payloads, digests,
        )  # fmt: skip


def _monotonic(wall: float | None) -> float | None:
    return None if wall is None else time.monotonic() + (wall - time.time())


def run_round(plan: RoundPlan, ctx: RoundContext, view: MembershipView) -> RoundResult:
    """See the module docstring."""
    t0, timing = time.monotonic(), ctx.timing
    if plan.scheduled is not None and not plan.last:
        # hivemind starts matchmaking at once whatever the scheduled time, so a step begun early joins
        # whichever ordinary round another peer is in: start looking only when the shared window opens.
        # A last round meets only other last rounds (a key of their own), so it looks at once: its groups
        # begin as soon as every member they expect is in, not seconds after the last of them has stopped
        time.sleep(max(0.0, plan.scheduled - timing.matchmaking_s - time.time()))
    wait = 0.0 if plan.scheduled is None else max(0.0, plan.scheduled - time.time())
    deadline = time.monotonic() + wait + timing.round_s
    rec = RoundRecord(step=plan.step, round=plan.index, last=plan.last, dense_group=1)  # until it runs
    rec.started_at = round(time.time() - (time.monotonic() - t0), 3)
    result = RoundResult(rec)
    local = {DENSE: plan.dense, CORE: [plan.dense[i] for i in ctx.core]}
    local |= {expert_item(e): ts for e, ts in plan.experts.items()}
    # served copies are final only once the holders have settled them after the last round (last_round)
    lagged = ctx.sync.lagged_refresh and not plan.last
    rec.expert_groups.update({str(e): 1 for e in plan.sole})
    meta = {"items": [DENSE], "step": plan.step, "round": plan.index, "last": plan.last}
    look_s = wait + timing.matchmaking_left(plan.slot, time.time())  # for groups that meet now
    if plan.look_until is not None:
        look_s = max(MIN_LOOK_S, min(look_s, plan.look_until - time.time()))
    begin_by = plan.scheduled
    if begin_by is None and plan.last:
        # peers reach their step limits seconds apart: a last round's group waits out its window for them
        # unless all it expects come first. hivemind's leader would otherwise begin with whoever came after
        # its own matchmaking time (on 2 cores, four finishers made two pairs, which the robust rule drops)
        begin_by = time.time() + 0.9 * look_s

    fetch, started, all_started, groups_done = None, [], threading.Event(), threading.Event()
    # after a last round, copies are fetched once the holders have settled them (last_round)
    if not plan.last and plan.refresh:
        holders = {
            e: [(p, view.step_of(p)) for p in view.holders.get(e, ()) if p != ctx.me] for e in plan.frozen
        }
        gate = None
        if ctx.sync.downloads_after_matchmaking:  # once every group we start has its members

            def have_members() -> bool:  # read only once the loop below has started every group
                return all_started.is_set() and all(g.formed(h[0]) for _, g, h in started if h is not None)

            gate = Gate(have_members, not_after=time.monotonic() + look_s)
        fetch = RoundDownloads.start(
            ctx.downloads,
            holders,
            plan.frozen,
            plan.step,
            deadline,
            plan.copy_steps,
            gate,
            groups_done if lagged else None,
            stopped_training(ctx.view_now),
            _monotonic(timing.next_meeting(plan.slot)),
        )

    # a round runs one of the two dense groups: the other's reference waits for its next round
    ctx.payloads.keep({spec.name for spec, _ in plan.groups} | dense_group_names(ctx.run_id))
    for spec, group in plan.groups:
        early = plan.prematched.get(spec.name)
        if plan.alone and is_dense(spec):
            if early is not None:  # met early, but nobody is in view now
                leave(group, early)
            started.append((spec, group, None))
            continue
        # a robust rule weights members equally: a weight is only what a member says of itself
        weights = {item: plan.weights[item] if weighted(ctx) else 1.0 for item in spec.items}
        try:
            since = time.monotonic()
            payload = ctx.payloads.encode(spec, local, weights)
            info = our_info(ctx, spec, view, plan.step, plan.index, plan.last, weights, payload.reference)
            since = add_time(rec.startup_seconds, "encode", since)
            if early is not None and early.reference == payload.reference:
                handle = group.trigger(early.handle, payload.tensors)
                rec.met_early.append(_label(spec))
            else:  # met early against another reference (another thread forgot ours): start as usual
                if early is not None:
                    leave(group, early)
                expected = expected_members(spec, view, ctx.me, plan.last)
                handle = group.start(payload.tensors, info.to_msg(), look_s, begin_by, expected)
        except Exception as e:  # a group that cannot start this round: its items keep their snapshots
            if early is not None:
                leave(group, early)
            rec.rejected.append(f"{_label(spec)}: {type(e).__name__}: {e}"[:200])
            started.append((spec, None, None))
            continue
        started.append((spec, group, (handle, payload)))
        add_time(rec.startup_seconds, "start", since)
    all_started.set()
    # the rest of the start-up is CPU work that our groups' members do not wait for, so it is done once the
    # groups look for members, not before (with a lossy codec it is a codec pass over our experts and our
    # payload, and int8 GPU peers' matchmaking phase took 0.47 s, median, against fp32's 0.09 s)
    since = time.monotonic()
    if plan.refresh:
        ctx.server.update({expert_item(e): plan.experts[e] for e in plan.sole}, plan.step, final=False)
        if lagged:  # what our last round agreed
            ctx.server.publish_staged()
    since = add_time(rec.startup_seconds, "serve", since)
    for *_, started_as in started:
        if started_as is not None:
            started_as[1].residuals  # noqa: B018 (error feedback's residual, cached: taken during the all-reduce)
    add_time(rec.startup_seconds, "residuals", since)
    rec.startup_s = round(time.monotonic() - t0, 3)

    # all outcomes first, each digest published as soon as its outcome passes the checks, and only then
    # the wait for the other members' digests: a member busy with another of its groups must not keep this
    # one waiting (a group's digests would otherwise arrive one group's wait apart)
    checked, outcomes_in = [], t0
    for spec, group, started_as in started:
        outcome, payload = GroupOutcome(False, "not started"), None
        if started_as is not None:
            handle, payload = started_as
            outcome = group.outcome(handle, timeout=max(0.1, deadline - time.monotonic()))
            outcomes_in = time.monotonic()
        size, why, published = check_outcome(
            spec, outcome, plan.last, ctx, local, payload, deadline, rec.check_seconds
        )
        checked.append((spec, group, payload, outcome, size, why, published))
    sent, phases = 0, Phases(rec, t0)
    formed = [c[3].formed_at for c in checked if c[3].formed_at is not None]
    if formed:  # the first group's: waiting for members, then the all-reduce (until the last outcome)
        phases.end("matchmaking", at=formed[0])
    phases.end("allreduce" if formed else "groups", at=outcomes_in)
    averaged: dict[str, list[torch.Tensor]] = {}
    behind = None  # (the dense group, its entry in rec.rejected) after a partial round of ours
    for spec, group, payload, outcome, size, why, published in checked:
        got, was_started, codec = None, payload is not None, ctx.payloads.codec_for(spec)
        if published is not None:
            got, why = confirm_outcome(
                spec, outcome, ctx, local, payload, published, deadline, rec.check_seconds
            )
        if got is None:
            if why == REFERENCES_DIFFER and spec.items == (DENSE,) and not ctx.payloads.reference_id(spec):
                source = take_reference(spec, outcome, ctx, plan.dense, deadline)
                why += f"; took the agreed one from {source[-8:]}" if source else "; none to take"
            elif "partial" in why and spec.items == (DENSE,) and not (codec.lossless or plan.last):
                behind = (spec, len(rec.rejected))  # the others may have applied it: once we serve, ask
            if was_started:  # one that could not start said why already; a lone dense group only serves
                rec.rejected.append(f"{_label(spec)}: {why}")
        else:
            averaged |= got
            # butterfly all-reduce: our n-1 foreign parts out, our averaged part back from the n-1
            wire = sum(codec.wire_bytes(t.numel()) for i in spec.items for t in local[i])
            sent += int(2 * wire * (size - 1) / size)
            rec.members[_label(spec)] = sorted(p[-6:] for p in outcome.members)
        serving_from = time.monotonic()
        copies = {i: averaged.get(i, local[i]) for i in spec.items}  # a failed item serves its snapshot
        if spec.items == (DENSE,):
            rec.dense_group = size
            if group is not None:
                # with a lossy codec, the agreed reference (a member that missed a round takes it from us)
                ref_id, ref = ctx.payloads.reference(spec)
                dense = copies[DENSE] if ref is None else ref[DENSE]
                # with prints of every copy we hold, which joiners check what others give them against
                prints = served_prints(dense, {**plan.frozen, **plan.experts}, plan.step, plan.copy_steps)
                served = list(pack(spec, {DENSE: dense}, {DENSE: 1.0}))
                _serve_quietly(group, served, meta | {"ref": ref_id} | prints, rec)
        elif spec.items == (CORE,):  # serves nothing: a joiner takes the dense group's copy
            rec.dense_group = size
        else:
            rec.expert_groups.update({i.removeprefix("expert"): size for i in spec.items})
            if lagged:  # served from our next refresh round's start
                ctx.server.stage(copies, plan.step)
            elif plan.refresh:
                ctx.server.update(copies, plan.step, final=False)
        add_time(rec.check_seconds, "serve", serving_from)
    if behind is not None:
        spec, entry = behind
        source = catch_up_reference(spec, ctx, view, plan.dense, deadline)
        rec.rejected[entry] += f"; took the agreed reference from {source[-8:]}" if source else ""
    phases.end("checks")
    groups_done.set()
    if DENSE in averaged:
        result.dense = (plan.dense, averaged[DENSE])
    if CORE in averaged:
        result.core = (local[CORE], averaged[CORE])
    for e in plan.experts:
        if expert_item(e) in averaged:
            result.experts[e] = (plan.experts[e], averaged[expert_item(e)])
        elif e in plan.sole:  # nobody else trains it: its average is its snapshot (an outer step may use it)
            result.experts[e] = (plan.experts[e], plan.experts[e])

    got: dict[int, list[torch.Tensor]] = {}
    if fetch is not None:
        got, rejected, failures = fetch.wait()
        result.downloads, rec.download_failures = got, failures
        result.download_steps = fetch.steps
        if fetch.began_at is not None:
            rec.downloads_began_s = round(fetch.began_at - t0, 3)
        if fetch.ended_at is not None:
            rec.downloads_ended_s, rec.downloads_waited_s = round(fetch.ended_at - t0, 3), fetch.waited_s
        rec.rejected += rejected
        phases.end("downloads")  # what is left of them once the groups are done
    merge_round(result, plan, ctx.sync, ctx.n_experts)
    phases.end("merge")

    rec.bytes_sent = sent
    rec.bytes_recv = sent + ctx.downloads.received  # downloads as they came (fp16 copies, encoded changes)
    held = [*plan.dense, *(t for ts in plan.experts.values() for t in ts)]  # snapshots, then results
    held += [
        t
        for pair in [result.dense, result.core, *result.experts.values()]
        if pair and pair[1] is not pair[0]
        for t in pair[1]
    ]
    rec.host_bytes = nbytes(held) + nbytes(t for ts in got.values() for t in ts)
    rec.sync_seconds = round(time.monotonic() - t0, 3)
    return result


def _label(spec: GroupSpec) -> str:
    return spec.items[0] if is_dense(spec) else "experts " + ",".join(i[6:] for i in spec.items)


def _serve_quietly(group, tensors, meta, rec: RoundRecord) -> None:
    try:
        group.serve(tensors, meta)
    except TimeoutError as e:  # the buffers are still locked by an all-reduce that overran: serve later
        rec.rejected.append(f"serving: {e}")
