"""SPES expert-merging warm-up: early on, each local expert moves towards its most similar experts.

For every MoE layer and local expert i: S_ij = cosine(w_gate_i, w_gate_j) for j != i, N_i = the top-k
most similar, theta_i <- theta_i + alpha_t * mean_{j in N_i}(theta_j - theta_i), with pre-merge values for
all experts, and alpha_t = merge_alpha * max(0, 1 - t / merge_warmup_steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def merge_alpha_at(step: int, merge_alpha: float, warmup_steps: int) -> float:
    if warmup_steps <= 0:
        return 0.0
    return merge_alpha * max(0.0, 1.0 - step / warmup_steps)


def should_merge(step: int, round_index: int, warmup_steps: int, merge_every: int) -> bool:
    return step < warmup_steps and round_index % merge_every == 0


@torch.no_grad()
def merge_experts(
    gate_up: torch.Tensor, down: torch.Tensor, local: list[int], alpha: float, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer. gate_up: [E, 2I, H] (gate rows first, as OLMoE), down: [E, H, I], both fresh copies of
    every expert. Returns merged [len(local), 2I, H] and [len(local), H, I] for the local experts."""
    n_experts, two_i, _ = gate_up.shape
    k = min(topk, n_experts - 1)
    gates = gate_up[:, : two_i // 2, :].reshape(n_experts, -1).float()
    idx = torch.tensor(local, dtype=torch.long)
    # cosines as one product of unit vectors: cosine_similarity broadcast to [E, E, I*H] built E^2 copies
    # of the gates (0.26 s a layer of wan.py's wide shape on one idle core, seconds on a busy peer; 0.016 s)
    unit = F.normalize(gates, dim=1)
    sim = unit[idx] @ unit.T  # [len(local), E]
    sim[torch.arange(len(local)), idx] = float("-inf")
    neighbours = sim.topk(k, dim=-1).indices  # [len(local), k]
    gu_i, dn_i = gate_up[idx].float(), down[idx].float()
    gu = gu_i + alpha * (gate_up[neighbours].float().mean(dim=1) - gu_i)
    dn = dn_i + alpha * (down[neighbours].float().mean(dim=1) - dn_i)
    return gu, dn
