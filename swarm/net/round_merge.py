"""The merge warm-up on a round's result (SPES's expert-merging warm-up; the math is ``swarm.sync.merge``).

    merge_round(result, plan, cfg.sync, n_experts)   # after averaging and downloads: edits result.experts

While ``step < merge_warmup_steps`` and the round index is a multiple of ``merge_every``, every local
expert moves towards its most similar experts of the same layer, judged on the freshest copies: our
averaged experts, the copies just downloaded, else the copies we hold.
"""

from __future__ import annotations

import torch

from swarm.config import SyncConfig
from swarm.net.expert_tensors import host_float, per_layer
from swarm.sync import merge_alpha_at, merge_experts, should_merge


def merge_round(result, plan, sc: SyncConfig, n_experts: int) -> None:
    """``result``: the round's ``RoundResult``; ``plan``: its ``RoundPlan``."""
    local = sorted(plan.experts)
    if not local or not should_merge(plan.step, plan.index, sc.merge_warmup_steps, sc.merge_every):
        return
    alpha = merge_alpha_at(plan.step, sc.merge_alpha, sc.merge_warmup_steps)
    fresh = {e: (result.experts[e][1] if e in result.experts else plan.experts[e]) for e in local}
    fresh |= {e: result.downloads.get(e, plan.frozen[e]) for e in plan.frozen}
    layers = [per_layer(fresh[e]) for e in range(n_experts)]
    merged: dict[int, list[torch.Tensor]] = {e: [] for e in local}
    for li in range(len(layers[0])):
        # one layer at a time in host fp32: frozen copies may be bf16 on a GPU
        gu = torch.stack([host_float(layers[e][li][0]) for e in range(n_experts)])
        dn = torch.stack([host_float(layers[e][li][1]) for e in range(n_experts)])
        mgu, mdn = merge_experts(gu, dn, local, alpha, sc.merge_topk)
        for row, e in enumerate(local):
            merged[e] += [mgu[row], mdn[row]]
    for e in local:
        result.experts[e] = (plan.experts[e], merged[e])
    result.record.merge_alpha = alpha
