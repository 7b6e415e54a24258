"""``SwarmSync``: the trainer's sync hook for a networked peer (SPES without a parameter server).

    sync = SwarmSync(cfg, dht, model)          # joins groups for the dense weights and each local expert
    trainer = Trainer(cfg, run_dir, sync=sync) # after_step() starts rounds and applies finished ones

Every ``sync_every`` steps a round starts in a background thread while training goes on: the trainable
tensors are snapshotted (s); the dense weights are averaged across the peers that show up, weighted by
tokens since the last round; each local expert among its holders, weighted by tokens routed to it; non-local
experts are downloaded from a holder; the merge warm-up runs on fresh copies. Each result passes the
partial-round consensus and the tensor checks, then the training thread applies it as
theta <- theta + alpha * (a - s), keeping the steps taken meanwhile. Nothing waits longer than
``round_timeout_s``; a failed part is dropped and logged.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch

from swarm.config import RunConfig
from swarm.model import MoETransformer
from swarm.net.averaging import AveragingGroup, download_state
from swarm.net.expert_tensors import (
    dense_tensors,
    expert_tensors,
    host_float,
    nbytes,
    overwrite,
    per_layer,
    side_stream,
    snapshot,
)
from swarm.net.final_agreement import FinalGroup, agree_on_final_copies
from swarm.net.records import (
    Heartbeat,
    expert_holders,
    publish_heartbeat,
    read_heartbeats,
    withdraw_heartbeat,
)
from swarm.net.round_consensus import confirm_round, digest, group_key
from swarm.net.traffic import TrafficMeter
from swarm.sync import (
    OuterStep,
    RejectedTensor,
    check_tensors,
    clamp_weight,
    merge_alpha_at,
    merge_experts,
    orphan_claim_rank,
    orphan_swap,
    should_merge,
)
from swarm.train.sync_hook import StepReport

# a peer cannot plausibly report more tokens for one round than this many times a round of this run's steps
MAX_WEIGHT_FACTOR = 100.0


@dataclass
class RoundResult:
    index: int
    step: int
    dense: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (snapshot, average)
    experts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    downloads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


class SwarmSync:
    """See the module docstring."""

    def __init__(
        self, cfg: RunConfig, dht: hivemind.DHT, model: MoETransformer, final_at: float | None = None
    ) -> None:
        self.cfg, self.dht, self.sc = cfg, dht, cfg.sync
        self.run_id, self.me = cfg.run_id, dht.peer_id.to_base58()
        self.final_at = (
            final_at  # wall time at which all peers of a run that stop together meet for a last round
        )
        self.n_experts = cfg.model.n_experts
        self.local = list(model.local_experts)
        self.device = model.embed.weight.device
        self.outer = OuterStep(self.sc.sync_alpha, self.sc.outer_momentum)
        self._group_kw = kw = dict(
            matchmaking_time=self.sc.matchmaking_s,
            allreduce_timeout=self.sc.round_timeout_s,
            request_timeout=min(3.0, self.sc.matchmaking_s / 2),
        )
        self.dense_group = AveragingGroup(dht, f"{self.run_id}_dense", dense_tensors(model), **kw)
        self.expert_groups = {
            e: AveragingGroup(dht, f"{self.run_id}_expert{e}", expert_tensors(model, e), **kw)
            for e in self.local
        }
        self.heartbeat = Heartbeat(experts=self.local, state="training", period_s=self.sc.heartbeat_s)
        self.traffic = TrafficMeter(dht.pid)
        self.holders: dict[int, set[str]] = {e: set() for e in range(self.n_experts)}
        self.peers: dict[str, Heartbeat] = {}
        self._tokens = 0
        self._expert_tokens = torch.zeros(self.n_experts, dtype=torch.long)
        self._round_index = 0
        self._step_tokens = 0
        self._finishing = False
        self._download_failures: list[str] = []
        self._last_step_time: float | None = None
        self._results: queue.Queue[RoundResult] = queue.Queue()
        self._in_flight: threading.Thread | None = None
        self._stop = threading.Event()
        self._hb_lock = threading.Lock()
        self._claimed: list[int] | None = None  # an orphan claim published but not yet switched to
        self._retired: list[AveragingGroup] = []  # groups of experts given up, shut down between rounds
        self._orphaned: dict[int, float] = {}  # expert -> since when (monotonic) it has had no live holder
        self.refresh_peers()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)
        self._hb_thread.start()

    # -- membership ---------------------------------------------------------------------------------------
    def refresh_peers(self) -> None:
        beats = read_heartbeats(self.dht, self.run_id, timeout=self.sc.heartbeat_s)
        if self.me not in beats:  # the DHT did not answer (or our record is not out yet): learn nothing
            return
        holders = expert_holders(beats, self.n_experts)
        now = time.monotonic()
        with self._hb_lock:
            self.peers, self.holders = {p: hb for p, (hb, _) in beats.items()}, holders
            for e, who in holders.items():
                if who:
                    self._orphaned.pop(e, None)
                else:
                    self._orphaned.setdefault(e, now)

    def _heartbeat_loop(self) -> None:
        # a fixed cadence, not "period after the last store and read": readers call a peer stale after two
        # missed periods, and a loaded machine's DHT calls would otherwise stretch every period
        tick = time.monotonic()
        while not self._stop.is_set():
            with self._hb_lock:
                hb = Heartbeat(**vars(self.heartbeat))
            publish_heartbeat(
                self.dht, self.run_id, self.me, hb, ttl_s=3 * self.sc.heartbeat_s, timeout=self.sc.heartbeat_s
            )
            self.refresh_peers()
            self._maybe_claim()
            tick = max(tick + self.sc.heartbeat_s, time.monotonic() - self.sc.heartbeat_s)
            self._stop.wait(max(0.0, tick - time.monotonic()))

    # -- the hook -----------------------------------------------------------------------------------------
    def after_step(self, model: MoETransformer, report: StepReport) -> list[dict[str, Any]]:
        self._tokens += report.step_tokens
        self._expert_tokens += report.expert_tokens.cpu()
        now = time.monotonic()
        with self._hb_lock:
            hb = self.heartbeat
            if self._last_step_time is not None and now > self._last_step_time:  # smoothed tokens/s
                rate = report.step_tokens / (now - self._last_step_time)
                hb.tokens_per_s = rate if hb.tokens_per_s == 0 else 0.9 * hb.tokens_per_s + 0.1 * rate
            hb.step, hb.tokens, hb.loss = report.step, report.tokens, report.loss
        self._last_step_time = now
        if report.step_tokens:
            self._step_tokens = report.step_tokens
        records = []
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()))
        if self._retired and not (self._in_flight is not None and self._in_flight.is_alive()):
            for group in self._retired:
                group.shutdown()
            self._retired.clear()
        if report.step % self.sc.sync_every == 0 and not report.last:  # a last step gets the last round
            if self._in_flight is not None and self._in_flight.is_alive():
                records.append(
                    {
                        "step": report.step,
                        "round": self._round_index,
                        "applied": False,
                        "reason": "previous round still in flight",
                    }
                )
            elif self._near_last_round():
                records.append(
                    {"step": report.step, "applied": False, "reason": "too close to the last round"}
                )
            else:
                self._start_round(model, report.step)
        return records

    def _near_last_round(self) -> bool:
        """Whether an ordinary round started now could still be matchmaking when the last round's window
        opens (it would meet the last round's steps, and that mixed group is dropped by all)."""
        if self.final_at is None:
            return False
        matchmaking = self.sc.matchmaking_s + self.sc.round_timeout_s / 4  # an ordinary step's time limit
        return time.time() + matchmaking >= self.final_at - self.sc.matchmaking_s

    def wanted_experts(self) -> list[int] | None:
        """The experts this peer has claimed but not switched to yet (see ``_maybe_claim``), or None."""
        return self._claimed

    def _maybe_claim(self) -> None:
        """An orphan re-claim (DESIGN: "Joining, claiming, leaving"): when an expert has had no live holder
        for ``orphan_grace_s`` and all our experts have another holder, give up our most replicated expert
        for it. Eligible peers wait their rank (``orphan_claim_rank``) in extra heartbeat periods, and the
        claim is published at once from this (heartbeat) thread, so the next in rank sees it in time; the
        trainer switches at its next step."""
        if self._finishing or self._claimed is not None:
            return
        with self._hb_lock:
            holders = {e: set(who) for e, who in self.holders.items()}
            now = time.monotonic()
            ages = {e: now - since for e, since in self._orphaned.items()}
        swap = orphan_swap(self.local, holders, ages, self.sc.orphan_grace_s, self.me)
        if swap is None:
            return
        give, take = swap
        rank = orphan_claim_rank(take, holders, self.me)
        if rank is None or ages[take] < self.sc.orphan_grace_s + 2 * rank * self.sc.heartbeat_s:
            return
        claimed = sorted(set(self.local) - {give} | {take})
        with self._hb_lock:
            self._claimed = claimed
            self.heartbeat.experts = list(claimed)
            hb = Heartbeat(**vars(self.heartbeat))
        publish_heartbeat(
            self.dht, self.run_id, self.me, hb, ttl_s=3 * self.sc.heartbeat_s, timeout=self.sc.heartbeat_s
        )

    def experts_changed(self, model: MoETransformer) -> None:
        """The trainer switched experts: leave the old experts' groups, join the new ones, tell the swarm."""
        new = list(model.local_experts)
        gone, came = sorted(set(self.local) - set(new)), sorted(set(new) - set(self.local))
        for e in gone:  # a round in flight may still use the group: it is shut down after that round
            self._retired.append(self.expert_groups.pop(e))
            self.outer.buffers = {
                k: v for k, v in self.outer.buffers.items() if not k.startswith(f"expert{e}.")
            }
        for e in came:
            self.expert_groups[e] = AveragingGroup(
                self.dht, f"{self.run_id}_expert{e}", expert_tensors(model, e), **self._group_kw
            )
        self.local = new
        with self._hb_lock:
            self._claimed = None
            self.heartbeat.experts = list(new)
            for e in came:
                self._orphaned.pop(e, None)
                self.holders[e].add(self.me)
            hb = Heartbeat(**vars(self.heartbeat))
        publish_heartbeat(
            self.dht, self.run_id, self.me, hb, ttl_s=3 * self.sc.heartbeat_s, timeout=self.sc.heartbeat_s
        )

    def finish(self, model: MoETransformer, report: StepReport) -> list[dict[str, Any]]:
        records = []
        if self._in_flight is not None:
            self._in_flight.join(timeout=self.sc.round_timeout_s + 5)
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()))
        self._finishing = True
        with self._hb_lock:  # a claim the trainer did not switch to in time is void: we hold what we hold
            self._claimed, self.heartbeat.experts = None, list(self.local)
        self._set_state("finishing")
        scheduled = None
        if self.final_at is not None:  # every peer of the run meets at the same moment for the last round
            scheduled = max(self.final_at, time.time() + self.sc.matchmaking_s)
        self._start_round(model, report.step, scheduled)
        self._in_flight.join(timeout=self.sc.round_timeout_s + max(0.0, (scheduled or 0) - time.time()) + 5)
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()) | {"final": True})
        adopted, unsettled = self._agree_on_final_copies(model, report.step)
        if records:
            records[-1].update(final_adopted=adopted, final_unsettled=unsettled)
            records[-1]["applied"] = records[-1]["applied"] or bool(adopted)
        self._linger()
        return records

    def _agree_on_final_copies(self, model: MoETransformer, step: int) -> tuple[list[str], list[str]]:
        beats = read_heartbeats(self.dht, self.run_id, timeout=self.sc.heartbeat_s)
        ending = {p for p, (hb, _) in beats.items() if hb.state in ("finishing", "done")} - {self.me}
        groups = {"dense": FinalGroup(self.dense_group, dense_tensors(model), ending)}
        for e in self.local:
            holders = {p for p, (hb, _) in beats.items() if e in hb.experts}
            groups[f"expert{e}"] = FinalGroup(
                self.expert_groups[e], expert_tensors(model, e), ending & holders
            )

        meta = {"step": step, "round": self._round_index, "final": True}
        timeout = min(10.0, self.sc.round_timeout_s / 3)
        # peers reach this point up to a round timeout apart (a late one may still have been in a round)
        window = self.sc.round_timeout_s + self.sc.matchmaking_s + 2 * timeout
        return agree_on_final_copies(
            self.dht, self.run_id, self.me, groups, meta, timeout, self.sc.max_rel_distance, window
        )

    def _set_state(self, state: str) -> None:
        with self._hb_lock:
            self.heartbeat.state = state
            hb = Heartbeat(**vars(self.heartbeat))
        publish_heartbeat(
            self.dht, self.run_id, self.me, hb, ttl_s=3 * self.sc.heartbeat_s, timeout=self.sc.heartbeat_s
        )

    def _linger(self) -> None:
        """Keep serving our experts until the other live peers have finished their last round too (they may
        still be downloading from us, or settling their replicas), at most a round timeout."""
        self._set_state("done")
        deadline = time.monotonic() + self.sc.round_timeout_s
        while time.monotonic() < deadline:
            beats = read_heartbeats(self.dht, self.run_id, timeout=self.sc.heartbeat_s)
            if all(hb.state == "done" for p, (hb, _) in beats.items() if p != self.me):
                return
            time.sleep(0.5)

    def _start_round(self, model: MoETransformer, step: int, scheduled: float | None = None) -> None:
        self._round_index += 1
        dense = snapshot(dense_tensors(model))
        experts = {e: snapshot(expert_tensors(model, e)) for e in self.local}
        # non-local experts do not change during a round (downloads are applied after it): the round reads
        # them in place, one tensor at a time, instead of holding a host copy of most of the model
        frozen = {e: expert_tensors(model, e) for e in range(self.n_experts) if e not in self.local}
        weights = {"dense": float(self._tokens)} | {e: float(self._expert_tokens[e]) for e in self.local}
        self._tokens, self._expert_tokens = 0, torch.zeros_like(self._expert_tokens)
        groups = dict(self.expert_groups)  # as of now: an expert switch during the round changes the dict
        args = (self._round_index, step, dense, experts, frozen, weights, groups, scheduled)
        self._in_flight = threading.Thread(target=self._run_round, args=args, name="swarm-round", daemon=True)
        self._in_flight.start()

    # -- a round (background thread) ---------------------------------------------------------------------
    def _run_round(self, *args) -> None:
        # on a GPU the round reads non-local experts on a stream of its own, so its copies to the host do not
        # queue behind the training step's kernels (nothing writes those experts while a round runs)
        with side_stream(self.device):
            self._round(*args)

    def _round(self, index, step, dense, experts, frozen, weights, groups, scheduled=None) -> None:
        t0 = time.monotonic()
        if scheduled is not None:
            # hivemind starts matchmaking at once whatever the scheduled time, so a step begun early joins
            # whichever ordinary round another peer is in: start looking only when the shared window opens
            time.sleep(max(0.0, scheduled - self.sc.matchmaking_s - time.time()))
        wait = 0.0 if scheduled is None else max(0.0, scheduled - time.time())
        deadline = time.monotonic() + wait + self.sc.round_timeout_s
        self.refresh_peers()  # who holds what, as of now: a sole holder skips averaging its expert
        wire0 = self.traffic.total()
        result = RoundResult(index, step)
        rec = result.record
        rec.update(step=step, round=index, expert_groups={}, rejected=[])
        # the same bound on every peer of the run (from the config, not from our own timing), so all members
        # of a group reach the same verdict on the weights they gathered
        max_w = MAX_WEIGHT_FACTOR * self.sc.sync_every * max(1, self._step_tokens)
        final = scheduled is not None or self._finishing
        info = {"step": step, "round": index, "final": final}
        controls = {}
        mm = wait + self.sc.matchmaking_s + self.sc.round_timeout_s / 4
        controls["dense"] = self.dense_group.start(
            dense,
            max(1.0, clamp_weight(weights["dense"], max_w)),
            info | {"weight": weights["dense"]},
            mm,
            scheduled,
        )
        for e in experts:
            if self.holders.get(e, set()) - {self.me}:
                w = clamp_weight(weights[e], max_w)
                controls[e] = groups[e].start(experts[e], max(w, 1.0), info | {"weight": w}, mm, scheduled)
            else:  # sole holder: nothing to average, but serve our copy to downloaders
                groups[e].publish(experts[e], info)
                rec["expert_groups"][str(e)] = 1
        sent = 0
        for name, control in controls.items():
            group = self.dense_group if name == "dense" else groups[name]
            local = dense if name == "dense" else experts[name]
            avg, size = self._finish(group, control, local, deadline, max_w, rec, name, info)
            if avg is None:  # keep serving a consistent copy (our snapshot) to peers that download it
                group.publish(local, info)
            if name == "dense":
                rec["dense_group"] = size
                result.dense = (local, avg) if avg is not None else None
            else:
                rec["expert_groups"][str(name)] = size
                if avg is not None:
                    result.experts[name] = (local, avg)
            if (
                avg is not None and size > 1
            ):  # butterfly all-reduce: our n-1 foreign parts out, our averaged part back to the n-1 others
                sent += int(2 * sum(t.numel() * 4 for t in local) * (size - 1) / size)  # received: as much
        recv = sent
        for e, mine in frozen.items():
            got = self._download(e, mine, step, final, deadline, rec)
            if got is not None:
                result.downloads[e] = got
                recv += nbytes(got)  # as it came off the wire (fp16), kept so until it is applied
        rec["download_failures"], self._download_failures = self._download_failures, []
        self._merge(result, experts, frozen, step, index)
        wire1 = self.traffic.total()
        rec.update(bytes_sent=sent, bytes_recv=recv, sync_seconds=round(time.monotonic() - t0, 3))
        held = [*dense, *(t for ts in experts.values() for t in ts)]  # snapshots, then results
        held += [t for pair in [result.dense, *result.experts.values()] if pair for t in pair[1]]
        rec["host_bytes"] = nbytes(held) + nbytes(t for ts in result.downloads.values() for t in ts)
        if wire0 is not None and wire1 is not None:
            rec["wire_bytes"] = wire1 - wire0  # measured at our p2pd: both directions, overhead included
        self._results.put(result)

    def _finish(self, group, control, local, deadline, max_w, rec, name, info):
        outcome = group.finish(control, timeout=max(0.1, deadline - time.monotonic()), meta=info)
        if not outcome.ok:
            rec["rejected"].append(f"{name}: {outcome.reason}")
            return None, 1
        members = outcome.members
        size = len(members)
        rec.setdefault("members", {})[str(name)] = sorted(peer[-6:] for peer in members)
        if any(
            not isinstance(m.get("weight"), (int, float)) or m["weight"] > max_w for m in members.values()
        ):
            rec["rejected"].append(f"{name}: a member reported an implausible weight")
            return None, size
        if any(m.get("final") != info["final"] for m in members.values()):
            # a last round must not mix with an ordinary one: the peer in the ordinary round trains on and
            # we would end holding a copy it never had (every member sees the same infos and drops it)
            rec["rejected"].append(f"{name}: a member was in another kind of round (last vs ordinary)")
            return None, size
        key = group_key(self.run_id, group.prefix, members)
        ok, why = confirm_round(
            self.dht,
            key,
            self.me,
            list(members),
            digest(outcome.tensors),
            timeout=max(0.5, min(10.0, deadline - time.monotonic())),
        )
        if not ok:
            rec["rejected"].append(f"{name}: {why}")
            return None, size
        try:
            check_tensors(str(name), outcome.tensors, local, self.sc.max_rel_distance)
        except RejectedTensor as e:
            rec["rejected"].append(str(e))
            return None, size
        return outcome.tensors, size

    def _fresh_state(self, peer: str, e: int, step: int, final: bool, deadline: float):
        """Expert e as served by ``peer``, waiting (until the deadline) while the holder is still finishing
        the same round: its result is the copy worth having. A holder behind us is taken as it is."""
        empty_answers = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0.5:
                return None
            got = download_state(
                self.dht, peer, f"{self.run_id}_expert{e}", timeout=min(left, self.sc.download_timeout_s)
            )
            if got is None:
                self._download_failures.append(f"expert{e} from {peer[-8:]}: no answer")
                return None
            if not isinstance(got[0], dict) or not isinstance(got[0].get("step"), int):
                # an averager answers with nothing while it is not sharing state yet: ask again shortly
                # (for a last round until the deadline: that copy is the one every peer must end with)
                empty_answers += 1
                if empty_answers >= 5 and not final:
                    why = f"no finished round (meta {str(got[0])[:60]})"
                    self._download_failures.append(f"expert{e} from {peer[-8:]}: {why}")
                    return None
                time.sleep(0.5)
                continue
            fresh = bool(got[0].get("final")) if final else got[0]["step"] >= step
            behind = self.peers.get(peer, Heartbeat([])).step < step
            if fresh or behind:
                return got
            time.sleep(0.5)

    def _download(
        self, e: int, mine: list[torch.Tensor], step: int, final: bool, deadline: float, rec
    ) -> list[torch.Tensor] | None:
        holders = sorted(
            self.holders.get(e, set()) - {self.me},
            key=lambda p: -self.peers[p].step if p in self.peers else 0,
        )
        for peer in holders[:2]:
            got = self._fresh_state(peer, e, step, final, deadline)
            if got is None:
                continue  # holder gone, or it has not finished a round yet
            # fp16 on the wire, but hivemind restores the sender's dtype: keep the fp16 values (no loss)
            tensors = [t.half() if t.dtype == torch.float32 else t for t in got[1]]
            try:
                check_tensors(f"expert{e}", tensors, mine, self.sc.max_rel_distance)
            except RejectedTensor as err:
                rec["rejected"].append(str(err))
                continue
            return tensors
        return None

    def _merge(self, result: RoundResult, experts, frozen, step: int, index: int) -> None:
        sc = self.sc
        local = sorted(experts)  # this round's local experts (a switch may have happened since)
        if not local or not should_merge(step, index, sc.merge_warmup_steps, sc.merge_every):
            return
        alpha = merge_alpha_at(step, sc.merge_alpha, sc.merge_warmup_steps)
        fresh = {e: (result.experts[e][1] if e in result.experts else experts[e]) for e in local}
        fresh |= {e: result.downloads.get(e, frozen[e]) for e in frozen}
        layers = [per_layer(fresh[e]) for e in range(self.n_experts)]
        merged: dict[int, list[torch.Tensor]] = {e: [] for e in local}
        for li in range(len(layers[0])):
            # one layer at a time in host fp32: frozen copies may be bf16 on a GPU
            gu = torch.stack([host_float(layers[e][li][0]) for e in range(self.n_experts)])
            dn = torch.stack([host_float(layers[e][li][1]) for e in range(self.n_experts)])
            mgu, mdn = merge_experts(gu, dn, local, alpha, sc.merge_topk)
            for row, e in enumerate(local):
                merged[e] += [mgu[row], mdn[row]]
        for e in local:
            result.experts[e] = (experts[e], merged[e])
        result.record["merge_alpha"] = alpha

    # -- applying (training thread) ------------------------------------------------------------------------
    def _apply(self, model: MoETransformer, result: RoundResult) -> dict[str, Any]:
        applied = []
        if result.dense is not None:
            self._outer("dense", dense_tensors(model), *result.dense)
            applied.append("dense")
        for e, (snap, avg) in result.experts.items():
            if e in model.local_experts:
                self._outer(f"expert{e}", expert_tensors(model, e), snap, avg)
                applied.append(f"expert{e}")
        for e, tensors in result.downloads.items():
            if e not in model.local_experts:
                overwrite(expert_tensors(model, e), tensors)
        rec = result.record
        rec["applied"] = bool(applied) or bool(result.downloads)
        rec["applied_groups"] = applied
        rec["downloaded"] = sorted(result.downloads)
        with self._hb_lock:
            hb = self.heartbeat
            hb.last_round, hb.last_round_time = result.index, time.time()
            hb.bytes_sent += rec.get("bytes_sent", 0)
            hb.bytes_recv += rec.get("bytes_recv", 0)
            hb.rounds_ok += int(not rec["rejected"])
            hb.rounds_failed += int(bool(rec["rejected"]))
        return rec

    def _outer(
        self, name: str, params: list[torch.Tensor], snap: list[torch.Tensor], avg: list[torch.Tensor]
    ) -> None:
        keys = [f"{name}.{i}" for i in range(len(params))]
        self.outer.apply(
            dict(zip(keys, params, strict=True)),
            dict(zip(keys, snap, strict=True)),
            dict(zip(keys, avg, strict=True)),
        )

    # -- leaving ------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._hb_thread.join(timeout=2 * self.sc.heartbeat_s)  # no heartbeat may land after the withdrawal
        with self._hb_lock:
            hb = Heartbeat(**vars(self.heartbeat))
        withdraw_heartbeat(self.dht, self.run_id, self.me, hb, ttl_s=3 * self.sc.heartbeat_s)  # at once
        if self._in_flight is not None:
            self._in_flight.join(timeout=self.sc.round_timeout_s)
        for g in [self.dense_group, *self.expert_groups.values(), *self._retired]:
            g.shutdown()
