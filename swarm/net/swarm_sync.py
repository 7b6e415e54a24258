"""``SwarmSync``: the trainer's sync hook for a networked peer (SPES without a parameter server).

    sync = SwarmSync(cfg, store, transport, model, members)   # see ``swarm.net.joining.join_swarm``
    reply = sync.after_step(model, report)   # starts rounds, applies finished ones; reply.switch_to
    records = sync.last_round(model, report) # the last round and the final agreement (``last_round``)

Every ``sync_every`` steps (or, with ``sync_every_s``, at each new slot of the wall clock, on all peers at
once) a round (``swarm.net.round.run_round``) starts in a background thread on a
snapshot of the trainable tensors while training goes on; its result is applied at a later step as
theta <- theta + alpha * (a - s), keeping the steps taken meanwhile. A round that overruns its bound is
abandoned, never awaited: the next sync point starts a new one. With ``sync.overlap`` off, training waits
for each round (at most its bound) and applies it before the next step.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import torch

from swarm.config import RunConfig
from swarm.model import MoETransformer
from swarm.net.copy_server import CopyServer
from swarm.net.expert_tensors import (
    core_index,
    dense_tensors,
    expert_tensors,
    overwrite,
    side_stream,
    snapshot,
)
from swarm.net.first_round import first_step_joins, partners_rounded
from swarm.net.group_layout import CORE, DENSE, dense_group_names, expert_item, layout
from swarm.net.membership import Membership
from swarm.net.prematch import Prematch
from swarm.net.round import RoundContext, RoundPlan, RoundResult, run_round
from swarm.net.timing import Timing
from swarm.net.transport import GroupTransport, Store
from swarm.sync import OuterStep
from swarm.train.round_record import RoundRecord
from swarm.train.sync_hook import Pools, StepReport, SyncReply

PLAIN = OuterStep()  # keeps no state: one for every peer
IN_FLIGHT = "previous round still in flight"
FRESH_VIEW_S = 0.5  # a view read this recently (at our first step, ``_others_round_in``) is not read again


class SwarmSync:
    """See the module docstring. ``last_round_at``: the wall time at which all peers of a run that stop
    together meet for their last round (None: whenever this peer stops)."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        transport: GroupTransport,
        model: MoETransformer,
        members: Membership,
        last_round_at: float | None = None,
        wire_meter=None,
    ) -> None:
        self.sc, self.timing, self.members = cfg.sync, Timing.from_config(cfg.sync), members
        self.transport, self.last_round_at, self.wire_meter = transport, last_round_at, wire_meter
        self.n_experts, self.device = cfg.model.n_experts, model.embed.weight.device
        self.outer = OuterStep(self.sc.sync_alpha, self.sc.outer_momentum)
        core = core_index(model) if self.sc.embeddings_every > 1 else ()
        self.ctx = replace(
            RoundContext.build(cfg, store, transport, self.timing), view_now=lambda: members.view, core=core
        )
        self.ctx.server.update(
            {expert_item(e): expert_tensors(model, e) for e in model.local_experts}, 0, False
        )
        # our copies of the experts we do not train, with the step each is from (0: the initialisation)
        self.copies = CopyServer(transport.open_server(f"{cfg.run_id}_copies"), model)
        self.copy_steps = {e: 0 for e in range(self.n_experts) if e not in model.local_experts}
        self._step = 0
        self._tokens, self._expert_tokens = 0, torch.zeros(self.n_experts, dtype=torch.long)
        self._step_tokens, self.round_index, self.leaving = 0, 0, False
        self._slot: int | None = None  # the wall-clock slot of the last step (sync_every_s)
        # a slot's sync point we reached with a round in flight: until this wall time, we may still join it
        self._late_until: float | None = None
        self._point = 0  # the swarm's number of the last sync point (its slot, or step // sync_every)
        self._results: queue.Queue[RoundResult] = queue.Queue()
        self._in_flight: threading.Thread | None = None
        self._in_flight_until = 0.0  # monotonic time after which a round still running is abandoned
        self._early: Prematch | None = None  # the next slot's groups, met before it (``sync.prematch_s``)

    def round_running(self) -> bool:
        running = self._in_flight is not None and self._in_flight.is_alive()
        return running and time.monotonic() < self._in_flight_until

    # -- the hook -----------------------------------------------------------------------------------------
    def copies_from(self, steps: dict[int, int]) -> None:
        """The steps of the copies we hold now (``CaughtUp.copy_steps``), which the copy server offers."""
        self.copy_steps |= {e: s for e, s in steps.items() if e in self.copy_steps}
        self.copies.update(self.copy_steps)

    def after_step(self, model: MoETransformer, report: StepReport) -> SyncReply:
        self._step = report.step
        self._tokens += report.step_tokens
        self._expert_tokens += report.expert_tokens.cpu()
        self.members.report_step(report.step, report.tokens, report.loss, report.step_tokens)
        self._step_tokens = report.step_tokens or self._step_tokens
        records = self.apply_finished(model)
        point = self._sync_point(report.step)
        early, self._early = (self._early, None) if point or report.last else (None, self._early)
        if self._late_until is not None and (point or report.last or time.time() >= self._late_until):
            self._late_until = None  # the slot's round went on without us
            records.append(RoundRecord(step=report.step, round=self.round_index, reason=IN_FLIGHT))
        if (point or self._late_until is not None) and not report.last:  # a last step gets the last round
            if self.round_running():
                if point and self.sc.sync_every_s > 0:
                    # the others look for partners for a while: if ours ends by then, join them late
                    # instead of skipping (a peer a slot out of step pairs off with others out of step)
                    self._late_until = self._slot * self.sc.sync_every_s + self.timing.matchmaking_s / 2
                elif point:
                    records.append(RoundRecord(step=report.step, round=self.round_index, reason=IN_FLIGHT))
            else:
                self._late_until = None
                # met early: the step limit was judged at the meeting, and the others went by that too
                if self._near_last_round(report, met_early=early is not None and early.slot == self._slot):
                    records.append(RoundRecord(step=report.step, reason="too close to the last round"))
                else:
                    self.start_round(model, report.step, early=early)
                    early = None
                    if not self.sc.overlap:  # training waits, and the next step starts from the average
                        self.wait_for_round()
                        records += self.apply_finished(model)
        if early is not None and report.last and not self.round_running():
            # met early, and our step limit came first: the others' all-reduce counts on us, so that round
            # goes on now (the last round waits for it); given up, it would leave them a partial all-reduce
            self.start_round(model, report.step, early=early)
            early = None
        if early is not None:  # met early for a round that did not start at its slot
            early.cancel()
        if not point and not report.last:
            self._meet_early(model, report)
        return SyncReply(records, self.members.claimed, self._pools(model))

    def _pools(self, model: MoETransformer) -> Pools:
        """The peers that average with us as of the latest view: all that train, and our experts' holders."""
        view, me = self.members.view, self.ctx.me
        live = {me, *view.partners(me)}
        held = [len(view.holders.get(e, frozenset()) & live) for e in model.local_experts]
        return Pools(dense=len(live), experts=max(1, min(held, default=1)))

    def _meet_early(self, model: MoETransformer, report: StepReport) -> None:
        """With ``sync.prematch_s``, meet the next slot's groups ``prematch_window_s`` before it, unless a round
        is in flight (its result may change our references) or the last round is near. A swarm's first
        round meets at its slot (``first_round``): in a demo, two peers that met it early and two that
        started 0.3 s into the slot made two pairs, which the robust rule drops."""
        if self.sc.prematch_window_s <= 0 or self._slot is None or self._early:
            return
        if self.round_index == 0 and not partners_rounded(self.members.view, self.ctx.me):
            return
        slot = self._slot + 1
        at = slot * self.sc.sync_every_s
        if (
            time.time() < at - self.sc.prematch_window_s
            or self.round_running()
            or self._near_last_round(report, slot=slot)
        ):
            return
        specs, _ = self._layout(model, slot)
        alone = not self.members.view.partners(self.ctx.me, ordinary=True)
        self._early = Prematch.begin(
            self.ctx, self.members.view, slot, self.round_index + 1, report.step, self._weights(model),
            (self._tokens, self._expert_tokens.clone()), self._groups(model, specs), alone, at,
        )  # fmt: skip

    def _layout(self, model: MoETransformer, point: int, last: bool = False):
        """(groups, experts held alone) of a round at sync ``point``: every ``sync.embeddings_every``-th
        averages all the dense weights, the others the core ones; a ``last`` round all of them."""
        full = last or point % self.sc.embeddings_every == 0
        view = self.members.view
        return layout(self.ctx.run_id, self.ctx.me, list(model.local_experts), view.holders, full)

    def _groups(self, model: MoETransformer, specs) -> list:
        """The layout's groups, opened on first use (``OpenGroups``) with our tensors' shapes."""
        dense = dense_tensors(model)
        local_tensors = {DENSE: dense, CORE: [dense[i] for i in self.ctx.core]} | {
            expert_item(e): expert_tensors(model, e) for e in model.local_experts
        }
        return [(spec, self.ctx.groups.get(spec, local_tensors)) for spec in specs]

    def _sync_point(self, step: int) -> bool:
        """Every ``sync_every`` steps, or with ``sync_every_s`` at the first step in a new slot of the wall
        clock. Our first step only sets where we are, unless it comes early in a slot whose round the others
        take (``first_round``)."""
        if self.sc.sync_every_s <= 0:
            self._point = step // self.sc.sync_every
            return step % self.sc.sync_every == 0
        slot = int(time.time() // self.sc.sync_every_s)
        due = slot > self._slot if self._slot is not None else self._others_round_in(slot)
        self._slot = self._point = slot
        return due

    def _others_round_in(self, slot: int) -> bool:
        began, window = slot * self.sc.sync_every_s, self.timing.matchmaking_s / 2
        if time.time() - began >= window:  # their groups stop looking soon
            return False
        self.members.refresh()  # once: the heartbeats of the last moments decide (a read may be slow)
        view, prematch = self.members.view, self.sc.prematch_window_s > 0
        return time.time() - began < window and first_step_joins(view, self.ctx.me, began, prematch)

    def _near_last_round(self, report: StepReport, met_early: bool = False, slot: int | None = None) -> bool:
        """Whether an ordinary round started now could still be matchmaking when the last round's window
        opens (it would meet the last round's steps, and that mixed group is dropped by all). A wall-clock
        round is judged by its ``slot``'s start (default: the current slot), the same on every peer: by the
        time of each peer's step, in a demo, the one whose step came 0.1 s before the cutoff went on with
        the groups met early while the three others left them, and its partial all-reduce took 45 s and
        its last round. With rounds on the wall clock, also within ``sync_every`` steps of the step limit
        (others may be in their last round by then; by steps, the limit is a sync point itself), unless the
        round's groups ``met_early`` while it was further: its members count on its all-reduce (on H100
        peers, one that gave up at the slot left the member that went on with a partial all-reduce)."""
        t, at, left = self.timing, self.last_round_at, report.steps_left
        by_steps = self.sc.sync_every_s > 0 and not met_early
        if by_steps and left is not None and left < self.sc.sync_every:
            return True
        slot = self._slot if slot is None else slot
        start = time.time() if self.sc.sync_every_s <= 0 or slot is None else slot * self.sc.sync_every_s
        return at is not None and start >= t.last_ordinary_start(at)

    def experts_changed(self, model: MoETransformer) -> None:
        """The trainer switched experts: serve the new ones, forget the old ones' momentum, tell the swarm.
        Groups follow by themselves: the next round's layout names them."""
        new = list(model.local_experts)
        # the experts we gave up are copies now, as of this step; those we took are no copies any more
        self.copy_steps = {
            e: self.copy_steps.get(e, self._step) for e in range(self.n_experts) if e not in new
        }
        self.copies.update(self.copy_steps)
        self.outer.keep({DENSE} | {expert_item(e) for e in new})
        self.ctx.server.update({expert_item(e): expert_tensors(model, e) for e in new}, 0, False)
        self.ctx.server.keep([expert_item(e) for e in new])
        self.members.set_experts(new)

    def last_round(self, model: MoETransformer, report: StepReport) -> list[RoundRecord]:
        from swarm.net.last_round import take_last_round

        return take_last_round(self, model, report)

    # -- rounds ---------------------------------------------------------------------------------------------
    def _weights(self, model: MoETransformer) -> dict[str, float]:
        """Each item's tokens since the last round, in sync intervals' worth."""
        unit = max(1.0, float(self.sc.sync_every * max(1, self._step_tokens)))  # same on every peer
        weights = {DENSE: max(1.0, self._tokens) / unit}
        weights[CORE] = weights[DENSE]
        weights |= {
            expert_item(e): max(1.0, float(self._expert_tokens[e])) / unit for e in model.local_experts
        }
        return {k: min(w, 100.0) for k, w in weights.items()}

    def start_round(
        self, model: MoETransformer, step: int, scheduled: float | None = None, early: Prematch | None = None
    ) -> None:
        """``early``: this slot's groups, met before it (``sync.prematch_s``), or the next slot's at our last
        step; used unless this is a last round, another round or slot began since, or the groups' layout
        changed."""
        self.round_index += 1
        first = self.round_index == 1 and early is None
        if first and time.monotonic() - self.members.view.read_at > FRESH_VIEW_S:
            # the heartbeat thread reads the swarm once a period (5 s): in a demo, peers that had started
            # since reached the first slot with views of one, two and four peers, and rounded alone or in
            # pairs. Later rounds (and a joiner's first, met early) find groups met in rounds past
            self.members.refresh(timeout=self.timing.matchmaking_s / 2)
        local = list(model.local_experts)
        last = scheduled is not None or self.leaving
        # groups met early at our last step are the next slot's
        specs, sole = self._layout(model, max(self._point, early.slot if early else 0), last)
        if early is not None and (
            last
            or early.index != self.round_index
            or early.slot < self._slot
            or [spec for spec, _ in early.groups] != specs  # our experts or their holders changed since
        ):
            early.cancel()
            early = None
        # an ordinary wall-clock round's slot: that of its early meeting (at our last step, the next one)
        slot = None if last else early.slot if early is not None else self._slot
        # no partner given our stop time starts an ordinary round after its last start: looking for members
        # longer than a matchmaking time past it only keeps our last round (and theirs) waiting
        at = self.last_round_at
        look_until = (
            None if last or at is None else self.timing.last_ordinary_start(at) + self.timing.matchmaking_s
        )
        if early is not None:  # its weights counted the tokens until it met: the rest count next time
            weights, groups = dict(early.weights), list(early.groups)
            self._tokens -= early.counted[0]
            self._expert_tokens -= early.counted[1]
        else:
            weights, groups = self._weights(model), self._groups(model, specs)
            self._tokens, self._expert_tokens = 0, torch.zeros_like(self._expert_tokens)
        plan = RoundPlan(
            self.round_index,
            step,
            snapshot(dense_tensors(model)),
            {e: snapshot(expert_tensors(model, e)) for e in local},
            # non-local experts do not change during a round (downloads are applied after it): the round
            # reads them in place instead of holding a host copy of most of the model
            {e: expert_tensors(model, e) for e in range(self.n_experts) if e not in local},
            weights,
            groups,
            sole,
            scheduled,
            last=last,
            alone=not self.members.view.partners(self.ctx.me, ordinary=not last),
            refresh=self._point % self.sc.refresh_every == 0,
            copy_steps=dict(self.copy_steps),
            prematched=early.handles if early is not None else {},
            slot=slot,
            look_until=look_until,
        )
        wait = 0.0 if scheduled is None else max(0.0, scheduled - time.time())
        self._in_flight_until = time.monotonic() + wait + self.timing.join_round_s
        self._in_flight = threading.Thread(
            target=self._run, args=(plan, self._in_flight_until), name="swarm-round", daemon=True
        )
        self._in_flight.start()

    def _run(self, plan: RoundPlan, bound: float) -> None:
        # on a GPU the round reads non-local experts on a stream of its own, so its copies to the host do not
        # queue behind the training step's kernels (nothing writes those experts while a round runs)
        wire0 = self.wire_meter.total() if self.wire_meter else None
        with side_stream(self.device):
            result = run_round(plan, self.ctx, self.members.view)
        if time.monotonic() > bound:  # abandoned meanwhile: a later round has replaced it
            result = RoundResult(result.record)
            result.record.rejected.append("the round overran its bound and was dropped")
        wire1 = self.wire_meter.total() if self.wire_meter else None
        if wire0 is not None and wire1 is not None:
            result.record.wire_bytes = wire1 - wire0  # at our p2pd: both directions, overhead included
            result.record.wire_total = wire1
        self._results.put(result)

    def wait_for_round(self) -> None:
        """Until the round in flight ends or is abandoned (its bound)."""
        if self._in_flight is not None:
            self._in_flight.join(timeout=max(0.0, self._in_flight_until - time.monotonic()))

    # -- applying (training thread) ------------------------------------------------------------------------
    def apply_finished(self, model: MoETransformer) -> list[RoundRecord]:
        records = []
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()))
        if records and not self.round_running():  # groups the layout no longer names: closed between rounds
            specs, _ = self._layout(model, self._point)
            keep = {s.name for s in specs} | dense_group_names(self.ctx.run_id)  # the next round's may differ
            self.transport.close_groups(self.ctx.groups.retire(keep))
        return records

    def _apply(self, model: MoETransformer, result: RoundResult) -> RoundRecord:
        # the last round is a plain average, whatever the outer optimizer: replicas must agree when we stop
        # (momentum buffers differ between peers that joined at different times)
        outer, applied = (PLAIN if result.record.last else self.outer), []
        if result.dense is not None:
            outer.apply_listed(DENSE, dense_tensors(model), *result.dense)
            applied.append(DENSE)
        if result.core is not None:  # the same outer state as those tensors' in a full dense round
            outer.apply_listed(DENSE, dense_tensors(model), *result.core, where=self.ctx.core)
            applied.append(CORE)
        for e, (snap, avg) in result.experts.items():
            if e in model.local_experts and not (
                avg is snap and outer.plain
            ):  # a sole holder's, plain: no-op
                outer.apply_listed(expert_item(e), expert_tensors(model, e), snap, avg)
                applied.append(expert_item(e))
        with self.copies.lock:
            for e, tensors in result.downloads.items():
                if e not in model.local_experts:
                    overwrite(expert_tensors(model, e), tensors)
        if result.downloads:
            self.took_copies({e: result.download_steps.get(e, result.record.step) for e in result.downloads})
        rec = result.record
        rec.applied, rec.applied_groups = bool(applied or result.downloads), applied
        rec.downloaded = sorted(result.downloads)
        self.members.record_round(rec)
        return rec

    def took_copies(self, steps: dict[int, int]) -> None:
        """New copies of these experts were written into the model, from these steps."""
        self.copy_steps |= {e: s for e, s in steps.items() if e in self.copy_steps}
        self.copies.update(self.copy_steps)

    def close(self) -> None:
        """Leave now: withdraw, give a round in flight a moment, close every group. A round still running
        is abandoned (its thread is a daemon; its calls fail once the groups are closed)."""
        self.members.close()
        if self._early is not None:
            self._early.cancel()
        if self._in_flight is not None:
            self._in_flight.join(timeout=min(2.0, max(0.0, self._in_flight_until - time.monotonic())))
        self.transport.close_groups([*self.ctx.groups.take_all(), *self.ctx.server.groups, self.copies.group])
