"""The local trainer of one peer: AdamW over trainable parameters only, schedule, validation, checkpoints.

Usage::

    trainer = Trainer(cfg, run_dir, sync=NoSync())
    trainer.setup(resume=True)      # fresh start, or exactly where the latest checkpoint left off
    trainer.train(max_steps=500)

Everything random comes from ``cfg.train.seed`` (weights, identical on every peer) and the data seed
(windows, different per peer); a resumed run reproduces the uninterrupted one.

With ``ranks`` (torchrun, see ``swarm.train.local_ranks``) every local rank runs this loop: DDP wraps the
model for the training forward/backward only; after each step rank 0's decisions reach the other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from swarm.config import ConfigError, RunConfig, save_config
from swarm.data import (
    WindowSampler,
    validation_batches,
)
from swarm.data.run_dataset import open_dataset
from swarm.model import MoETransformer, check_backend
from swarm.train.checkpoint import CheckpointError, save_checkpoint
from swarm.train.local_ranks import LocalRanks, NullMetrics
from swarm.train.metrics_log import MetricsLog
from swarm.train.optimizer import (
    build_optimizer,
    load_optimizer_tensors,
    optimizer_tensors,
    remap_expert_moments,
    set_lr,
)
from swarm.train.pooled_moment import PooledMomentAdamW, clip_factor
from swarm.train.run_dir import check_run_dir, find_checkpoint
from swarm.train.schedule import lr_at
from swarm.train.step_batches import step_batches
from swarm.train.sync_hook import NoSync, Pools, StepReport, SyncHook


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name} requested but CUDA is not available")
    return torch.device(name)


class Trainer:
    """One peer's training loop (see module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        sync: SyncHook | None = None,
        progress: bool = True,
        ranks: LocalRanks | None = None,
        stop: threading.Event | None = None,  # set with each Ctrl+C: see train()
    ) -> None:
        self.cfg, self.run_dir, self.sync, self.progress = cfg, Path(run_dir), sync or NoSync(), progress
        self.stop = stop
        self.step, self.tokens, self.ranks = 0, 0, ranks
        self.model: MoETransformer | None = None  # the raw model: rounds, evaluation, checkpoints use it
        self.metrics: MetricsLog | NullMetrics = NullMetrics()  # until setup() has passed its checks
        self._saved_at = time.monotonic()  # of the last checkpoint (or the start): train.checkpoint_every_s
        self.evaluate_at_start = False  # a resumed peer that caught up with the swarm: its loss from there
        self._ddp: torch.nn.Module | None = None  # DDP around it for the training forward/backward
        self.pools = Pools()  # who averages our weights, as the sync hook last said (train.pooled_moment)

    @property
    def is_leader(self) -> bool:
        """Whether this process writes the run dir: a plain peer, or rank 0 of several local ranks."""
        return self.ranks is None or self.ranks.is_leader

    # -- set-up -------------------------------------------------------------------------------------------
    def setup(self, resume: bool = False, local_experts: list[int] | None = None) -> None:
        """Build data, model and optimizer. A local rank > 0 only builds (LocalRanks.share_setup calls it
        with rank 0's experts): it reads no checkpoint and writes nothing."""
        cfg = self.cfg
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = self.ranks.device if self.ranks is not None else pick_device(cfg.train.device)
        check_backend(cfg.model.moe_backend, self.device)
        if self.is_leader:
            check_run_dir(self.run_dir, cfg)
        self.dataset = open_dataset(cfg, self.progress)
        data_seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed + 1
        self.sampler = WindowSampler(self.dataset, cfg.data.seq_len, cfg.data.micro_batch, seed=data_seed)
        self.val = validation_batches(
            self.dataset, cfg.data.seq_len, cfg.data.micro_batch, cfg.data.val_batches
        )
        ckpt = find_checkpoint(self.run_dir, cfg, resume) if self.is_leader else None
        if ckpt is not None:
            local_experts = ckpt.state["local_experts"]
        local = local_experts if local_experts is not None else cfg.experts.resolve(cfg.model.n_experts)
        torch.manual_seed(cfg.train.seed)
        t = cfg.train
        self.model = MoETransformer(
            cfg.model,
            local,
            cfg.experts.frozen_dtype,
            loss_chunk_tokens=t.loss_chunk_tokens,
            activation_checkpointing=t.activation_checkpointing,
        )
        self.model.init_weights(cfg.train.seed)
        self.model.to(self.device)
        if t.compile if t.compile is not None else self.device.type == "cuda":
            self.model.compile()  # keeps the module object; an expert switch recompiles
        self.optimizer = build_optimizer(self.model, cfg.train)
        if not self.is_leader:
            self.metrics = NullMetrics()
            return
        save_config(cfg, self.run_dir / "config.yaml")  # only now: every check above has passed
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        if ckpt is not None:
            self._restore(ckpt)
        else:
            self.metrics.truncate_after(-1)  # a fresh run starts a fresh history

    def _restore(self, ckpt) -> None:
        try:
            self.model.load_canonical_state_dict(ckpt.model)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {ckpt.path}: {e}") from None
        load_optimizer_tensors(self.model, self.optimizer, ckpt.optimizer)
        self.step, self.tokens = ckpt.step, int(ckpt.state["tokens"])
        self.sampler.load_state_dict(ckpt.state["sampler"])
        pools = ckpt.state.get("pools", [1, 1])  # older checkpoints have none
        if not (
            isinstance(pools, list) and len(pools) == 2 and all(isinstance(x, int) and x >= 1 for x in pools)
        ):
            raise CheckpointError(f"checkpoint {ckpt.path}: invalid pools {pools!r}")
        self._set_pools(Pools(*pools))
        dropped = self.metrics.truncate_after(self.step)
        msg = f"resumed from {ckpt.path} at step {self.step} ({dropped} later metric records dropped)"
        print(msg, file=sys.stderr)

    # -- pieces of a step ---------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.train.autocast_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy on the held-out validation windows (same windows on every call and peer);
        NaN on a local rank > 0 (only rank 0 evaluates)."""
        if not self.is_leader:
            return math.nan
        self.model.eval()
        total = 0.0
        for batch in self.val:
            batch = batch.to(self.device)
            with self._autocast():
                total += self.model(batch[:, :-1], targets=batch[:, 1:]).lm_loss.item()
        self.model.train()
        return total / len(self.val)

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        lr = lr_at(self.step, cfg.train)
        set_lr(self.optimizer, lr)
        accum = cfg.train.grad_accum
        lm = lb = z = 0.0
        expert_tokens = torch.zeros(cfg.model.n_experts, dtype=torch.long, device=self.device)
        if self.ranks is not None and self._ddp is None:  # wrapped again after an expert switch
            self._ddp = self.ranks.wrap(self.model)
        module = self.model if self._ddp is None else self._ddp
        # alone (pools of 1) a step needs no halves: it is plain AdamW, and a partner's first rounds find
        # the noise estimate warm within a few dozen steps (beta2's half-life)
        pooled = (
            isinstance(self.optimizer, PooledMomentAdamW) and max(self.pools.dense, self.pools.experts) > 1
        )
        batches = step_batches(self.sampler, accum, halves=pooled)
        n = len(batches)
        for i, batch in enumerate(batches):
            batch = batch.to(self.device, non_blocking=True)
            if pooled and i == n // 2:
                if self.ranks is not None:  # DDP averages only at the last backward: the peer's half
                    self.ranks.average_gradients(self.model.trainable_parameters())
                self.optimizer.mark_half()  # the first half's gradient: the noise that pooling removes
            sync_grads = module is self.model or i == n - 1  # DDP: all-reduce after the last one only
            with contextlib.nullcontext() if sync_grads else module.no_sync():
                with self._autocast():
                    out = module(batch[:, :-1], targets=batch[:, 1:])
                (out.loss / n).backward()
            lm, lb, z = lm + out.lm_loss.item() / n, lb + out.lb_loss.item() / n, z + out.z_loss.item() / n
            expert_tokens += out.expert_tokens
        if self.ranks is not None:  # the swarm sees the whole peer: tokens summed, losses averaged over ranks
            expert_tokens, (lm, lb, z) = self.ranks.reduce_step(expert_tokens, (lm, lb, z))
        params = self.model.trainable_parameters()
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        skipped = not math.isfinite(grad_norm)
        if not skipped and pooled:  # the kept half is scaled as clipping scaled the gradient
            self.optimizer.step(grad_scale=clip_factor(grad_norm, clip))
        elif not skipped:  # a non-finite gradient would poison weights and moments: drop this update
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += self._step_tokens()
        rec = {
            "step": self.step,
            "tokens": self.tokens,
            "loss": lm,
            "lr": lr,
            "lb_loss": lb,
            "z_loss": z,
            "grad_norm": grad_norm,
            "expert_tokens": expert_tokens.cpu(),
        }
        if skipped:
            rec["skipped"] = True
        return rec

    def switch_experts(self, experts: list[int]) -> None:
        """Train ``experts`` from now on (an orphan re-claim). A newcomer's weights are our latest copy of
        it; optimizer moments move with the experts we keep and start at zero for the newcomer."""
        old_ids, moments = self.model.local_experts, optimizer_tensors(self.model, self.optimizer)
        self.model.set_local_experts(experts)
        self._ddp = None  # new parameter objects: DDP wraps them afresh at the next step
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        self._set_pools(self.pools)
        load_optimizer_tensors(
            self.model, self.optimizer, remap_expert_moments(moments, old_ids, self.model.local_experts)
        )
        self.metrics.write(step=self.step, experts_switched={"from": old_ids, "to": self.model.local_experts})
        print(
            f"step {self.step}: now training experts {self.model.local_experts} (was {old_ids})",
            file=sys.stderr,
        )
        self.sync.experts_changed(self.model)

    def _set_pools(self, pools: Pools) -> None:
        self.pools = pools
        if isinstance(self.optimizer, PooledMomentAdamW):
            self.optimizer.set_pools(pools.dense, pools.experts)

    def save(self) -> Path | None:
        self._saved_at = time.monotonic()
        if not self.is_leader:
            return None
        state = {
            "tokens": self.tokens,
            "fingerprint": self.cfg.fingerprint(),
            "run_id": self.cfg.run_id,
            "local_experts": self.model.local_experts,
            "sampler": self.sampler.state_dict(),
            "pools": [self.pools.dense, self.pools.experts],  # a resumed step divides as this one did
        }
        return save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self.model.canonical_state_dict(),
            optimizer_tensors(self.model, self.optimizer),
            state,
            keep=self.cfg.train.keep_checkpoints,
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def _pace(self, until: float) -> None:
        """Sleep until ``until`` (monotonic): ``train.min_step_s``. A stop request ends the wait."""
        stop = self.stop or threading.Event()  # without one, a plain sleep
        while (wait := until - time.monotonic()) > 0 and not stop.is_set():
            stop.wait(wait)

    def train(self, max_steps: int | None = None, max_seconds: float | None = None) -> dict[str, Any]:
        """Train until ``max_steps`` optimizer steps in total, or for ``max_seconds`` of wall time.
        Returns a summary (initial/final validation loss)."""
        t = self.cfg.train
        target = t.max_steps if max_steps is None else max_steps
        stop_at = None if max_seconds is None else time.monotonic() + max_seconds
        self._saved_at = time.monotonic()
        summary: dict[str, Any] = {"start_step": self.step}
        if self.step == 0:
            summary["initial_val_loss"] = self.evaluate()
            self.metrics.write(step=0, tokens=0, val_loss=summary["initial_val_loss"])
        elif self.evaluate_at_start and self.is_leader:  # resumed, then caught up with the swarm
            summary["caught_up_val_loss"] = self.evaluate()
            self.metrics.write(step=self.step, tokens=self.tokens, val_loss=summary["caught_up_val_loss"])
        every = 1.0 if sys.stderr.isatty() else 10.0
        bar = tqdm(total=target, initial=self.step, disable=not self.progress, unit="step", dynamic_ncols=True,
                   mininterval=every, desc=f"peer {self.cfg.run_id}")  # fmt: skip
        window_t, window_tok = time.perf_counter(), 0
        out_of_time = stop_at is not None and time.monotonic() >= stop_at
        if self.ranks is not None:  # rank 0's clock (and resumed pools) decide for every rank
            shared = self.ranks.share_decisions(self.model, self.step, [], None, out_of_time, self.pools)
            out_of_time = shared.stop
            self._set_pools(shared.pools)
        try:
            while self.step < target:
                if self.stop is not None and self.stop.is_set():  # a Ctrl+C whose KeyboardInterrupt
                    raise KeyboardInterrupt  # was lost where Python ignores exceptions (an at-fork hook)
                if out_of_time:
                    target = self.step  # out of time: this is the last step
                    self.save()
                    break
                began = time.monotonic()
                rec = self.train_step()
                window_tok += self._step_tokens()
                out_of_time = stop_at is not None and time.monotonic() >= stop_at
                report = StepReport(
                    self.step,
                    self.tokens,
                    self._step_tokens(),
                    rec.pop("expert_tokens"),
                    rec["loss"],
                    last=self.step == target or out_of_time,
                    steps_left=target - self.step,
                )
                reply = self.sync.after_step(self.model, report)
                records, wanted = [r.to_dict() for r in reply.records], reply.switch_to
                if reply.pools is not None and reply.pools != self.pools:
                    self._set_pools(reply.pools)
                    if isinstance(self.optimizer, PooledMomentAdamW):  # what its steps divide by from now on
                        self.metrics.write(step=self.step, pools=dataclasses.asdict(reply.pools))
                if self.ranks is not None:  # rank 0's round results and decisions reach every rank
                    shared = self.ranks.share_decisions(
                        self.model, self.step, records, wanted, out_of_time, self.pools
                    )
                    wanted, out_of_time = shared.switch_to, shared.stop
                    if shared.pools != self.pools:  # every rank splits its next step as rank 0 does
                        self._set_pools(shared.pools)
                for round_rec in records:
                    self.metrics.write(**round_rec)
                if wanted is not None and sorted(wanted) != self.model.local_experts:
                    self.switch_experts(wanted)
                last = self.step == target
                do_eval = self.step % t.eval_every == 0 or last
                if do_eval or self.step % t.log_every == 0 or last:
                    now = time.perf_counter()
                    rec["tokens_per_s"] = window_tok / max(now - window_t, 1e-9)
                    if do_eval:
                        rec["val_loss"] = self.evaluate()
                    self.metrics.write(**rec)
                    bar.set_postfix(
                        loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False
                    )
                    window_t, window_tok = time.perf_counter(), 0  # evaluation time is not training time
                bar.update(1)
                overdue = (
                    t.checkpoint_every_s > 0 and time.monotonic() - self._saved_at >= t.checkpoint_every_s
                )
                if self.step % t.checkpoint_every == 0 or last or overdue:
                    self.save()
                if t.min_step_s > 0 and not last:
                    self._pace(began + t.min_step_s)
        except KeyboardInterrupt:
            if self.is_leader:
                print(f"\ninterrupted at step {self.step}: writing a checkpoint", file=sys.stderr)
            self.save()
            raise
        finally:
            bar.close()
        final: list[dict[str, Any]] = []  # the last round's records, after our last step
        if self.step > summary["start_step"]:  # a last synchronous round: replicas agree when we stop
            if self.ranks is not None:  # did DDP keep the ranks equal? (checked before the last round)
                check = self.ranks.check_weights(self.model, self.step, "trained")
                self.metrics.write(step=self.step, ranks_check="end of training", **check)
            report = StepReport(
                self.step, self.tokens, 0, torch.zeros(self.cfg.model.n_experts, dtype=torch.long), 0.0
            )
            final = [r.to_dict() for r in self.sync.last_round(self.model, report)]
            if self.ranks is not None:
                self.ranks.share_decisions(self.model, self.step, final, None, True, self.pools)
            for round_rec in final:
                self.metrics.write(**round_rec)
            if any(r.get("applied") for r in final):
                self.save()  # the checkpoint holds the weights the last round agreed on
        summary.update(end_step=self.step, tokens=self.tokens, final_val_loss=self.evaluate())
        if final and self.is_leader:
            # the weights the run ends with: the last round and the final agreement came after the last
            # step's evaluation (and a peer stopped by the clock has none at its last step)
            self.metrics.write(step=self.step, tokens=self.tokens, val_loss=summary["final_val_loss"])
        return summary

    def _step_tokens(self) -> int:
        ranks = self.ranks.world_size if self.ranks is not None else 1
        return self.cfg.train.grad_accum * self.cfg.data.micro_batch * self.cfg.data.seq_len * ranks

    def close(self) -> None:
        self.sync.close()
        self.metrics.close()  # a set-up that failed half-way leaves the null log: its error is what shows
