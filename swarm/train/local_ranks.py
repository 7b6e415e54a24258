"""Several devices in one peer: the local ranks of a ``torchrun`` launch train one peer with DDP.

Usage (``peers/main.py`` wires it)::

    ranks = LocalRanks.from_env()          # None unless torchrun started WORLD_SIZE > 1 processes
    ranks.init(pick_device(cfg.train.device), timeout_s=collective_timeout_s(cfg))
    trainer = Trainer(cfg, run_dir, ranks=ranks)
    if ranks.is_leader:
        ...                                # set up as a single peer would: resume, --init-from, the swarm
    ranks.share_setup(trainer)             # every rank: rank 0's experts, step, tokens, weights, moments
    trainer.train(...)                     # DDP forward/backward; rank 0's decisions reach every rank
    ranks.close()

Only rank 0 talks to the swarm and writes to the run dir. After every optimizer step rank 0 broadcasts
one control tensor (weights changed by a round, stop now, switch experts, the pools that
``train.pooled_moment`` divides by) and, when a round changed the weights, every parameter and buffer
(frozen experts are buffers). Optimizer moments stay equal without help: DDP gives every rank the same
gradients, rounds never touch moments, and with ``train.pooled_moment`` the kept first half of a step is
averaged over the ranks (``average_gradients``) before the optimizer keeps it.

``SWARM_RANK_DUMPS=1`` (for tests) makes every rank save its canonical weights whenever the ranks' weights
are checked, as ``run_dir/rank_dumps/{label}-step{S}-rank{R}.safetensors``, so that a test can compare the
ranks independently of the digest logged as ``ranks_weight_spread``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from swarm.config import RunConfig
from swarm.train.optimizer import load_optimizer_tensors, optimizer_tensors
from swarm.train.sync_hook import Pools

if TYPE_CHECKING:
    from swarm.model import MoETransformer
    from swarm.train.trainer import Trainer

# the control tensor's slots; the wanted-expert mask starts at _MASK
_CHANGED, _STOP, _SWITCH, _DENSE_POOL, _EXPERT_POOL, _MASK = range(6)


@dataclass(frozen=True)
class RankDecisions:
    """Rank 0's decisions after a step, as every rank receives them (``LocalRanks.share_decisions``)."""

    switch_to: list[int] | None  # the experts to train from now on, or None
    stop: bool
    pools: Pools  # what PooledMomentAdamW divides by: every rank must split its steps alike


def collective_timeout_s(cfg: RunConfig) -> float:
    """How long a rank waits in a collective: longer than rank 0 may spend away from the others (joining
    and catching up, or the last round with its final agreement and lingering)."""
    s = cfg.sync
    return s.join_settle_s + s.download_timeout_s + 5 * s.round_timeout_s + 4 * s.matchmaking_s + 60


class NullMetrics:
    """The metrics log of a rank > 0: only rank 0 writes metrics.jsonl."""

    def write(self, **record: Any) -> None:
        pass

    def truncate_after(self, step: int) -> int:
        return 0

    def close(self) -> None:
        pass


class LocalRanks:
    """This process's place among the local ranks of one peer (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, local_rank: int) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = torch.device("cpu")
        self.dump_dir: Path | None = None

    @classmethod
    def from_env(cls) -> LocalRanks | None:
        """The ranks torchrun describes in the environment, or None for a plain single-process peer."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device, timeout_s: float) -> None:
        """Join the process group: nccl on ``cuda:LOCAL_RANK``, gloo over loopback on CPU."""
        if device.type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = device
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this machine
            backend = "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        """Leave the process group (ranks still waiting on this one then fail at once, not at a timeout)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- set-up -------------------------------------------------------------------------------------------
    def share_setup(self, trainer: Trainer) -> None:
        """Every rank starts where rank 0 stands. Rank 0 calls this after its own set-up (resume,
        --init-from, catch-up, expert claims); the others set up here, with rank 0's experts, and take its
        step, tokens, weights and optimizer moments (a resumed run has moments)."""
        meta = [None]
        if self.is_leader:
            meta = [
                {
                    "experts": trainer.model.local_experts,
                    "step": trainer.step,
                    "tokens": trainer.tokens,
                    "data_seed": trainer.sampler.seed,
                }
            ]
        dist.broadcast_object_list(meta, src=0, device=self._object_device())
        m = meta[0]
        if not self.is_leader:
            # each rank samples its own windows; a resumed rank moves on to windows it has not seen
            trainer.cfg.data.seed = m["data_seed"] + self.rank + self.world_size * m["step"]
            trainer.setup(local_experts=m["experts"])
            trainer.step, trainer.tokens = m["step"], m["tokens"]
        self.dump_dir = trainer.run_dir / "rank_dumps" if os.environ.get("SWARM_RANK_DUMPS") == "1" else None
        self.broadcast_weights(trainer.model)
        if m["step"] > 0:
            moments = [None]
            if self.is_leader:
                moments = [
                    {k: v.cpu() for k, v in optimizer_tensors(trainer.model, trainer.optimizer).items()}
                ]
            dist.broadcast_object_list(moments, src=0, device=self._object_device())
            if not self.is_leader:
                load_optimizer_tensors(trainer.model, trainer.optimizer, moments[0])

    # -- training -----------------------------------------------------------------------------------------
    def wrap(self, model: MoETransformer) -> torch.nn.Module:
        """DDP around ``model`` for the training forward/backward (re-wrap after an expert switch).
        It syncs nothing itself, neither at construction nor per step: the ranks already hold the same
        weights (``share_setup``, ``broadcast_weights``), and the frozen experts are large buffers."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, init_sync=False, forward_sync_buffers=False)

    def reduce_step(
        self, expert_tokens: torch.Tensor, losses: tuple[float, ...]
    ) -> tuple[torch.Tensor, tuple[float, ...]]:
        """The peer's step: expert token counts summed over ranks, losses averaged (one all-reduce)."""
        losses_t = torch.tensor(losses, dtype=torch.float64, device=expert_tokens.device)
        packed = torch.cat([expert_tokens.to(torch.float64), losses_t]).to(self.device)
        dist.all_reduce(packed)
        n = expert_tokens.numel()
        tokens = packed[:n].round().to(expert_tokens.device, torch.long)
        return tokens, tuple((packed[n:] / self.world_size).tolist())

    def share_decisions(
        self,
        model: MoETransformer,
        step: int,
        records: list[dict],
        wanted: list[int] | None,
        stop: bool,
        pools: Pools,
    ) -> RankDecisions:
        """After a step (or the last round): rank 0's decisions reach every rank. Rank 0 passes its round
        ``records``, the hook's ``wanted`` experts, its ``stop`` decision and its ``pools``; the other ranks'
        arguments are ignored. Weights a round changed are broadcast and checked (rank 0's applied records get
        ``ranks`` and ``ranks_weight_spread``)."""
        n_experts = model.cfg.n_experts
        ctl = torch.zeros(_MASK + n_experts, dtype=torch.long)
        if self.is_leader:
            ctl[_CHANGED] = any(r.get("applied") for r in records)
            ctl[_STOP] = bool(stop)
            ctl[_DENSE_POOL], ctl[_EXPERT_POOL] = pools.dense, pools.experts
            if wanted is not None:
                ctl[_SWITCH] = 1
                ctl[_MASK + torch.tensor(sorted(wanted), dtype=torch.long)] = 1
        ctl = ctl.to(self.device)
        dist.broadcast(ctl, src=0)
        ctl = ctl.cpu()
        if ctl[_CHANGED]:
            self.broadcast_weights(model)
            check = self.check_weights(model, step, "round")
            for r in records:
                if r.get("applied"):
                    r.update(check)
        switch = ctl[_MASK:].nonzero().flatten().tolist() if ctl[_SWITCH] else None
        return RankDecisions(switch, bool(ctl[_STOP]), Pools(int(ctl[_DENSE_POOL]), int(ctl[_EXPERT_POOL])))

    @torch.no_grad()
    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Every rank's ``params``' gradients become their mean over the ranks (one all-reduce of them all,
        flattened; a missing gradient counts as zeros). DDP averages only at a step's last backward; the
        pooled moment's first half has to be the peer's, not one rank's."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        for p, mean in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            if p.grad is None:
                p.grad = mean.view_as(p).clone()
            else:
                p.grad.copy_(mean.view_as(p))

    # -- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_weights(self, model: MoETransformer) -> None:
        """Rank 0's parameters and buffers (the frozen experts) overwrite every other rank's, in place."""
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)

    @torch.no_grad()
    def check_weights(self, model: MoETransformer, step: int, label: str) -> dict[str, Any]:
        """Compare the ranks' weights: each rank digests every tensor (float64 sum and sum of squares);
        returns ``{"ranks": N, "ranks_weight_spread": largest difference between ranks}`` (0.0: equal)."""
        tensors = [*model.parameters(), *model.buffers()]
        digest = torch.stack(
            [torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]
        ).flatten()
        both = torch.cat([digest, -digest])  # max of both halves: the largest and the smallest value
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        spread = float((both[: digest.numel()] + both[digest.numel() :]).max())
        if self.dump_dir is not None:
            from safetensors.torch import save_file

            self.dump_dir.mkdir(parents=True, exist_ok=True)
            path = self.dump_dir / f"{label}-step{step}-rank{self.rank}.safetensors"
            save_file({k: v.contiguous() for k, v in model.canonical_state_dict().items()}, str(path))
        return {"ranks": self.world_size, "ranks_weight_spread": spread}

    def _object_device(self) -> torch.device:
        # nccl moves pickled objects through the GPU; gloo through the CPU
        return self.device if self.device.type == "cuda" else torch.device("cpu")
