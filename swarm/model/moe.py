"""The MoE feed-forward layer: softmax top-k router and SwiGLU experts split into local and frozen banks.

A peer trains only some experts (SPES). Their weights are ``nn.Parameter``s in the *local* bank; every other
expert lives in a *frozen* bank of plain buffers (optionally bf16) that autograd never differentiates. Tokens
are still routed to all experts: the dispatch sorts token copies so that local experts come first, then runs
one grouped GEMM over both banks whose weight gradient covers the local rows only
(``expert_gemm.split_bank_linear``). Frozen experts therefore get input gradients only, never weight
gradients, and no gradient or optimizer memory exists for them. Nothing in the layer reads a count back to
the host, so ``torch.compile`` sees it as one graph.

Canonical layout (what checkpoints, export and the swarm see) is the HF OLMoE fused one:
``gate_up[e] = cat(gate_e, up_e)`` of shape [2I, H] and ``down[e]`` of shape [H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelConfig
from swarm.model.expert_gemm import grouped_linear, split_bank_linear


@dataclass
class RouterStats:
    """What one MoE layer reports besides its output: raw router logits and top-k choices."""

    logits: torch.Tensor  # [T, E] fp32
    top_idx: torch.Tensor  # [T, k]


class ExpertBanks(nn.Module):
    """The experts of one layer, split into a trainable local bank and a frozen bank.

    ``local_ids`` are the canonical indices of the local experts (sorted); ``frozen_ids`` the rest.
    """

    def __init__(self, cfg: ModelConfig, local_ids: list[int], frozen_dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_hidden
        self.n_experts, self.hidden, self.inner, self.backend = e, h, i, cfg.moe_backend
        self.local_ids = sorted(local_ids)
        self.frozen_ids = [x for x in range(e) if x not in set(self.local_ids)]
        n_loc, n_fro = len(self.local_ids), len(self.frozen_ids)
        self.gate_up_local = nn.Parameter(torch.empty(n_loc, 2 * i, h))
        self.down_local = nn.Parameter(torch.empty(n_loc, h, i))
        self.register_buffer("gate_up_frozen", torch.empty(n_fro, 2 * i, h, dtype=frozen_dtype))
        self.register_buffer("down_frozen", torch.empty(n_fro, h, i, dtype=frozen_dtype))
        # rank[e] = position of canonical expert e in the (local..., frozen...) dispatch order
        rank = torch.empty(e, dtype=torch.long)
        rank[torch.tensor(self.local_ids + self.frozen_ids, dtype=torch.long)] = torch.arange(e)
        self.register_buffer("rank", rank, persistent=False)

    # -- canonical view ---------------------------------------------------------------------------------
    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full [E, 2I, H] and [E, H, I] fp32 copies in canonical expert order (detached)."""
        gu = torch.empty(self.n_experts, 2 * self.inner, self.hidden, device=self.rank.device)
        dn = torch.empty(self.n_experts, self.hidden, self.inner, device=self.rank.device)
        if self.local_ids:
            gu[self.local_ids] = self.gate_up_local.detach().float()
            dn[self.local_ids] = self.down_local.detach().float()
        if self.frozen_ids:
            gu[self.frozen_ids] = self.gate_up_frozen.float()
            dn[self.frozen_ids] = self.down_frozen.float()
        return gu, dn

    @torch.no_grad()
    def load_canonical(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        want_gu, want_dn = (
            (self.n_experts, 2 * self.inner, self.hidden),
            (self.n_experts, self.hidden, self.inner),
        )
        if tuple(gate_up.shape) != want_gu or tuple(down.shape) != want_dn:
            raise ValueError(
                f"expert tensors have shapes {tuple(gate_up.shape)}/{tuple(down.shape)}, "
                f"expected {want_gu}/{want_dn}"
            )
        if self.local_ids:
            self.gate_up_local.copy_(gate_up[self.local_ids])
            self.down_local.copy_(down[self.local_ids])
        if self.frozen_ids:
            self.gate_up_frozen.copy_(gate_up[self.frozen_ids])
            self.down_frozen.copy_(down[self.frozen_ids])

    # -- compute ----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; top_idx/top_w: [T, k]. Returns sum_k w_k * expert_k(x) as [T, H]."""
        t, k = top_idx.shape
        rank = self.rank[top_idx.reshape(-1)]
        order = torch.argsort(rank, stable=True)
        token_of = order // k
        counts = expert_counts(rank, self.n_experts)
        xs = x[token_of]
        if self.backend == "megablocks" and self.local_ids and self.frozen_ids:
            ys = self._two_banks(xs, counts)
        else:
            gu = self._linear(xs, self.gate_up_local, self.gate_up_frozen, counts)
            g, u = gu.chunk(2, dim=-1)
            ys = self._linear(F.silu(g) * u, self.down_local, self.down_frozen, counts)
        ys = ys * top_w.reshape(-1)[order, None].to(ys.dtype)
        out = torch.zeros(t, self.hidden, device=x.device, dtype=ys.dtype)
        return out.index_add_(0, token_of, ys)

    def _linear(self, xs, w_local, w_frozen, counts) -> torch.Tensor:
        if not self.frozen_ids:
            return grouped_linear(xs, w_local, counts, self.backend)
        if not self.local_ids:
            return grouped_linear(xs, w_frozen, counts, self.backend)
        return split_bank_linear(xs, w_local, w_frozen, counts)

    def _two_banks(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """megablocks: one GEMM per bank, split at the number of local rows (a host sync per layer)."""
        n_loc = len(self.local_ids)
        rows = int(counts[:n_loc].sum())
        parts = []
        for xb, gu_w, dn_w, c in (
            (xs[:rows], self.gate_up_local, self.down_local, counts[:n_loc]),
            (xs[rows:], self.gate_up_frozen, self.down_frozen, counts[n_loc:]),
        ):
            if xb.shape[0]:  # a bank no token reached is skipped
                g, u = grouped_linear(xb, gu_w, c, self.backend).chunk(2, dim=-1)
                parts.append(grouped_linear(F.silu(g) * u, dn_w, c, self.backend))
        return torch.cat(parts)


class TopKRouter(nn.Module):
    """Linear gate, softmax in fp32, top-k, optional renormalisation of the top-k weights (HF OLMoE)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight).float()
        probs = logits.softmax(dim=-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return logits, top_w, top_idx


class MoELayer(nn.Module):
    """Router + expert banks. ``forward`` returns the layer output and the router statistics."""

    def __init__(self, cfg: ModelConfig, local_ids: list[int], frozen_dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = ExpertBanks(cfg, local_ids, frozen_dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits, top_w, top_idx = self.gate(flat)
        out = self.experts(flat, top_idx, top_w.to(x.dtype))
        return out.to(x.dtype).view(b, t, h), RouterStats(logits, top_idx)


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many entries of ``idx`` name each expert: ``bincount`` with a fixed length, which the compiler
    can trace (``bincount``'s output size depends on the data)."""
    flat = idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.long)
    )


def load_balancing_loss(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """Switch-style auxiliary loss pooled over all layers, exactly as HF's ``load_balancing_loss_func``:
    E * sum_e f_e * P_e with f_e the fraction of top-k slots and P_e the mean router probability."""
    counts = sum(expert_counts(s.top_idx, n_experts).float() for s in stats)
    probs = sum(s.logits.softmax(dim=-1).sum(dim=0) for s in stats)
    rows = sum(s.logits.shape[0] for s in stats)
    return n_experts * torch.sum((counts / rows) * (probs / rows))


def router_z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens and layers of logsumexp(logits)^2."""
    return torch.stack([torch.logsumexp(s.logits, dim=-1).pow(2).mean() for s in stats]).mean()


def routed_token_counts(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, summed over layers (weights of the per-expert swarm average)."""
    return sum(expert_counts(s.top_idx, n_experts) for s in stats)
