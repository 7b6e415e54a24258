"""AdamW over a peer's trainable parameters, and its state as flat named tensors for safetensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from swarm.config import TrainConfig
from swarm.model import MoETransformer
from swarm.train.checkpoint import CheckpointError
from swarm.train.pooled_moment import PooledMomentAdamW

# per-parameter state with the parameter's shape (PooledMomentAdamW adds its noise estimate)
MOMENT_SLOTS = ("exp_avg", "exp_avg_sq", "noise_sq")


def build_optimizer(model: MoETransformer, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters only, in ``adamw_groups``. On CUDA the fused kernel (one launch for
    all parameters; the for-each version took 20% of a spes-1b step on an H100). With ``t.pooled_moment``,
    ``PooledMomentAdamW`` (pools of 1 until ``set_pools``)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if t.pooled_moment:
        return PooledMomentAdamW(adamw_groups(trainable, t), lr=t.lr, betas=t.betas, eps=t.eps)
    fused = all(p.is_cuda for _, p in trainable)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(adamw_groups(trainable, t), lr=t.lr, betas=t.betas, eps=t.eps, **kind)


def adamw_groups(named: Iterable[tuple[str, torch.nn.Parameter]], t: TrainConfig) -> list[dict[str, Any]]:
    """Parameter groups: matrices decay, norms do not, and experts (``.experts.`` in the name, ours or HF
    OLMoE's) carry ``lr_scale`` = ``t.expert_lr_scale``, which ``set_lr`` applies; every group says whether it
    holds experts (``experts``). Empty groups left out."""
    decay, no_decay, experts = [], [], []
    for name, p in named:
        (experts if ".experts." in name else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay, "lr_scale": 1.0, "experts": False},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0, "experts": False},
        {"params": experts, "weight_decay": t.weight_decay, "lr_scale": t.expert_lr_scale, "experts": True},
    ]
    return [g for g in groups if g["params"]]


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to ``lr`` times its ``lr_scale`` (1 where a group has none)."""
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def optimizer_tensors(model: MoETransformer, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``{"<param>/<slot>": tensor}``; moments of the embedding and LM head without vocabulary padding rows
    (a checkpoint shows the true vocabulary size)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        name = names[id(p)]
        for key, value in st.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{name}/{key}"] = model.unpadded(name, value) if value.shape == p.shape else value
    return out


def load_optimizer_tensors(
    model: MoETransformer, opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor]
) -> None:
    params = dict(model.named_parameters())
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, slot = key.rpartition("/")
        if name not in params:
            raise CheckpointError(f"optimizer state for unknown parameter {name}")
        if slot in MOMENT_SLOTS:
            value = model.padded(name, value)
        state.setdefault(name, {})[slot] = value
    for name, st in state.items():
        p = params[name]
        for slot in MOMENT_SLOTS:
            if slot in st and st[slot].shape != p.shape:
                raise CheckpointError(f"optimizer state {name}/{slot} has shape {tuple(st[slot].shape)}")
        # the step counter stays on the CPU, except for the fused kernel that reads it on the device
        fused = bool(opt.defaults.get("fused"))
        opt.state[p] = {k: (v.to(p.device) if k != "step" or fused else v) for k, v in st.items()}


def remap_expert_moments(
    flat: dict[str, torch.Tensor], old_experts: list[int], new_experts: list[int]
) -> dict[str, torch.Tensor]:
    """Optimizer state (``optimizer_tensors``) for a peer that switches from ``old_experts`` to
    ``new_experts``: the local expert banks keep one row per local expert in sorted order, so rows of kept
    experts move to their new place and a newly claimed expert starts with zero moments."""
    old_ids, new_ids = sorted(old_experts), sorted(new_experts)
    out = {}
    for key, value in flat.items():
        name, _, slot = key.rpartition("/")
        if name.endswith("_local") and slot in MOMENT_SLOTS:
            rows = torch.zeros((len(new_ids), *value.shape[1:]), dtype=value.dtype, device=value.device)
            for i, e in enumerate(new_ids):
                if e in old_ids:
                    rows[i] = value[old_ids.index(e)]
            value = rows
        out[key] = value
    return out
