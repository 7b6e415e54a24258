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
from swarm.net.averaging import AveragingGroup, shutdown_groups
from swarm.net.expert_download import ExpertDownloads
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
from swarm.net.final_agreement import agree_on_final_copies, final_groups
from swarm.net.membership import Membership
from swarm.net.round_consensus import confirm_round, digest, group_key
from swarm.net.timing import Timing
from swarm.net.traffic import TrafficMeter
from swarm.sync import (
    OuterStep,
    RejectedTensor,
    check_tensors,
    clamp_weight,
    merge_alpha_at,
    merge_experts,
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
        self, cfg: RunConfig, dht: hivemind.DHT, model: MoETransformer, last_round_at: float | None = None
    ) -> None:
        self.cfg, self.dht, self.sc, self.timing = cfg, dht, cfg.sync, Timing.from_config(cfg.sync)
        self.run_id, self.me = cfg.run_id, dht.peer_id.to_base58()
        self.last_round_at = (
            last_round_at  # wall time at which all peers of a run that stop together meet for a last round
        )
        self.n_experts = cfg.model.n_experts
        self.local = list(model.local_experts)
        self.device = model.embed.weight.device
        self.outer = OuterStep(self.sc.sync_alpha, self.sc.outer_momentum)
        self._group_kw = kw = dict(
            matchmaking_time=self.timing.matchmaking_s,
            allreduce_timeout=self.timing.round_s,
            request_timeout=self.timing.request_s,
        )
        self.dense_group = AveragingGroup(dht, f"{self.run_id}_dense", dense_tensors(model), **kw)
        self.expert_groups = {
            e: AveragingGroup(dht, f"{self.run_id}_expert{e}", expert_tensors(model, e), **kw)
            for e in self.local
        }
        self.traffic = TrafficMeter(dht.pid)
        self._tokens = 0
        self._expert_tokens = torch.zeros(self.n_experts, dtype=torch.long)
        self._round_index = 0
        self._step_tokens = 0
        self._leaving = False
        self.downloads = ExpertDownloads(dht, self.run_id, self.timing.download_s, self.sc.max_rel_distance)
        self._results: queue.Queue[RoundResult] = queue.Queue()
        self._in_flight: threading.Thread | None = None
        self._retired: list[AveragingGroup] = []  # groups of experts given up, shut down between rounds
        self.members = Membership(
            dht, self.run_id, self.timing, self.local, self.n_experts, self.sc.orphan_grace_s
        )

    # -- the hook -----------------------------------------------------------------------------------------
    def after_step(self, model: MoETransformer, report: StepReport) -> list[dict[str, Any]]:
        self._tokens += report.step_tokens
        self._expert_tokens += report.expert_tokens.cpu()
        self.members.report_step(report.step, report.tokens, report.loss, report.step_tokens)
        if report.step_tokens:
            self._step_tokens = report.step_tokens
        records = []
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()))
        if self._retired and not (self._in_flight is not None and self._in_flight.is_alive()):
            shutdown_groups(self._retired)
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
        if self.last_round_at is None:
            return False
        t = self.timing
        return time.time() + t.ordinary_matchmaking_s >= self.last_round_at - t.matchmaking_s

    def wanted_experts(self) -> list[int] | None:
        """The experts this peer has claimed for an orphan but not switched to yet, or None."""
        return self.members.claimed

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
        self.members.set_experts(new)

    def last_round(self, model: MoETransformer, report: StepReport) -> list[dict[str, Any]]:
        records = []
        if self._in_flight is not None:
            self._in_flight.join(timeout=self.timing.join_round_s)
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()))
        self._leaving = True
        self.members.set_state("finishing")  # a claim the trainer did not switch to in time is void
        scheduled = None
        if (
            self.last_round_at is not None
        ):  # every peer of the run meets at the same moment for the last round
            scheduled = max(self.last_round_at, time.time() + self.timing.matchmaking_s)
        self._start_round(model, report.step, scheduled)
        self._in_flight.join(timeout=self.timing.join_round_s + max(0.0, (scheduled or 0) - time.time()))
        while not self._results.empty():
            records.append(self._apply(model, self._results.get()) | {"final": True})
        adopted, unsettled = self._agree_on_final_copies(model, report.step)
        if records:
            records[-1].update(final_adopted=adopted, final_unsettled=unsettled)
            records[-1]["applied"] = records[-1]["applied"] or bool(adopted)
        # keep serving our experts until the others have finished their last round too (they may still be
        # downloading from us, or settling their replicas), at most a round timeout
        self.members.set_state("done")
        self.members.wait_until_others_done(self.timing.round_s)
        return records

    def _agree_on_final_copies(self, model: MoETransformer, step: int) -> tuple[list[str], list[str]]:
        self.members.refresh()
        peers = self.members.view.peers
        groups = final_groups(peers, self.me, self.dense_group, self.expert_groups, model)
        meta, t = {"step": step, "round": self._round_index, "final": True}, self.timing
        return agree_on_final_copies(
            self.dht, self.run_id, self.me, groups, meta, t.final_agreement_s, self.sc.max_rel_distance,
            t.final_window_s,
        )  # fmt: skip

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
            time.sleep(max(0.0, scheduled - self.timing.matchmaking_s - time.time()))
        wait = 0.0 if scheduled is None else max(0.0, scheduled - time.time())
        deadline = time.monotonic() + wait + self.timing.round_s
        self.members.refresh()  # who holds what, as of now: a sole holder skips averaging its expert
        view = self.members.view
        wire0 = self.traffic.total()
        result = RoundResult(index, step)
        rec = result.record
        rec.update(step=step, round=index, expert_groups={}, rejected=[])
        # the same bound on every peer of the run (from the config, not from our own timing), so all members
        # of a group reach the same verdict on the weights they gathered
        max_w = MAX_WEIGHT_FACTOR * self.sc.sync_every * max(1, self._step_tokens)
        final = scheduled is not None or self._leaving
        info = {"step": step, "round": index, "final": final}
        controls = {}
        mm = wait + self.timing.ordinary_matchmaking_s
        controls["dense"] = self.dense_group.start(
            dense,
            max(1.0, clamp_weight(weights["dense"], max_w)),
            info | {"weight": weights["dense"]},
            mm,
            scheduled,
        )
        for e in experts:
            if view.holders.get(e, frozenset()) - {self.me}:
                w = clamp_weight(weights[e], max_w)
                controls[e] = groups[e].start(experts[e], max(w, 1.0), info | {"weight": w}, mm, scheduled)
            else:  # sole holder: nothing to average, but serve our copy to downloaders
                groups[e].publish(experts[e], info)
                rec["expert_groups"][str(e)] = 1
        sent = 0
        for name, control in controls.items():
            group = self.dense_group if name == "dense" else groups[name]
            local = dense if name == "dense" else experts[name]
            avg, size = self._verified_outcome(group, control, local, deadline, max_w, rec, name, info)
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
            from_peers = [(p, view.step_of(p)) for p in view.holders.get(e, frozenset()) - {self.me}]
            got = self.downloads.fetch(e, from_peers, mine, step, final, deadline, rec["rejected"])
            if got is not None:
                result.downloads[e] = got
                recv += nbytes(got)  # as it came off the wire (fp16), kept so until it is applied
        rec["download_failures"] = self.downloads.take_failures()
        self._merge(result, experts, frozen, step, index)
        wire1 = self.traffic.total()
        rec.update(bytes_sent=sent, bytes_recv=recv, sync_seconds=round(time.monotonic() - t0, 3))
        held = [*dense, *(t for ts in experts.values() for t in ts)]  # snapshots, then results
        held += [t for pair in [result.dense, *result.experts.values()] if pair for t in pair[1]]
        rec["host_bytes"] = nbytes(held) + nbytes(t for ts in result.downloads.values() for t in ts)
        if wire0 is not None and wire1 is not None:
            rec["wire_bytes"] = wire1 - wire0  # measured at our p2pd: both directions, overhead included
        self._results.put(result)

    def _verified_outcome(self, group, control, local, deadline, max_w, rec, name, info):
        outcome = group.outcome(control, timeout=max(0.1, deadline - time.monotonic()), meta=info)
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
        self.members.record_round(rec)
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
        self.members.close()
        if self._in_flight is not None:
            self._in_flight.join(timeout=self.timing.round_s)
        shutdown_groups([self.dense_group, *self.expert_groups.values(), *self._retired])
