"""Decoder-only MoE transformer with OLMoE math, written for one device.

Usage::

    model = MoETransformer(cfg.model, local_experts=[0, 1, 2, 3], frozen_dtype=torch.bfloat16)
    model.init_weights(seed=0)            # identical weights on every peer, whatever its local experts
    out = model(tokens[:, :-1], targets=tokens[:, 1:])
    out.loss.backward()                   # gradients only for dense weights and experts 0-3

``canonical_state_dict()`` gives every expert in the full [E, ...] layout regardless of the local split;
checkpoints, export and the swarm exchange that form. The embedding and the LM head hold
``padded_vocab`` rows (a multiple of 128: a vocabulary such as 151665 otherwise runs the head on slow GEMM
kernels); the padding rows stay zero, their logits are never scored, and every canonical view (checkpoints,
export, the swarm) shows the true ``vocab_size`` rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelConfig
from swarm.model.layers import Attention, RMSNorm, RotaryEmbedding
from swarm.model.linear_cross_entropy import linear_cross_entropy
from swarm.model.moe import MoELayer, load_balancing_loss, routed_token_counts, router_z_loss

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB_PAD = 128
VOCAB_ROWS = ("embed.weight", "lm_head.weight")  # tensors with one row per vocabulary entry


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, vocab_size]; None when targets were given (the loss is chunked)
    loss: torch.Tensor | None = None  # lm + lb_coef * lb + z_coef * z
    lm_loss: torch.Tensor | None = None
    lb_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    expert_tokens: torch.Tensor | None = None  # [E] token copies routed to each expert, all layers


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, local_ids: list[int], frozen_dtype: torch.dtype) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.moe = MoELayer(cfg, local_ids, frozen_dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        x = x + self.attn(self.attn_norm(x), rope)
        y, stats = self.moe(self.ffn_norm(x))
        return x + y, stats


def _expert_keys(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.moe.experts.gate_up", f"layers.{layer}.moe.experts.down"


class MoETransformer(nn.Module):
    """The model one peer holds in full. ``local_experts`` are trainable; the rest are frozen buffers."""

    def __init__(
        self,
        cfg: ModelConfig,
        local_experts: list[int] | None = None,
        frozen_dtype: str | torch.dtype = torch.float32,
        *,
        loss_chunk_tokens: int = 1024,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.loss_chunk_tokens, self.activation_checkpointing = loss_chunk_tokens, activation_checkpointing
        self.frozen_dtype = _DTYPES[frozen_dtype] if isinstance(frozen_dtype, str) else frozen_dtype
        self.local_experts = sorted(range(cfg.n_experts) if local_experts is None else local_experts)
        self.padded_vocab = -(-cfg.vocab_size // VOCAB_PAD) * VOCAB_PAD
        self.embed = nn.Embedding(self.padded_vocab, cfg.d_model)
        self.layers = nn.ModuleList(
            Block(cfg, self.local_experts, self.frozen_dtype) for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, self.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    # -- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) for every matrix, ones for norms. Each canonical tensor draws from its own
        generator seeded by (seed, name), so the weights do not depend on which experts are local."""
        state = {}
        for name, shape in self.canonical_shapes().items():
            if name.endswith("norm.weight"):
                state[name] = torch.ones(shape)
                continue
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            state[name] = torch.randn(shape, generator=gen) * self.cfg.init_std
        self.load_canonical_state_dict(state)

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.cfg
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in self.named_parameters():
            if ".experts." not in name:
                shapes[name] = tuple(p.shape)
                if name in VOCAB_ROWS:
                    shapes[name] = (cfg.vocab_size, *p.shape[1:])
        for layer in range(cfg.n_layers):
            gu, dn = _expert_keys(layer)
            shapes[gu] = (cfg.n_experts, 2 * cfg.expert_hidden, cfg.d_model)
            shapes[dn] = (cfg.n_experts, cfg.d_model, cfg.expert_hidden)
        return dict(sorted(shapes.items()))

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights, experts in full [E, ...] canonical order, fp32, detached copies."""
        out = {n: t.float().clone() for n, t in self.dense_tensors().items()}
        for layer, block in enumerate(self.layers):
            gu, dn = _expert_keys(layer)
            out[gu], out[dn] = block.moe.experts.canonical()
        return out

    @torch.no_grad()
    def load_canonical_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy canonical tensors in (strict: every key present, shapes checked)."""
        want = self.canonical_shapes()
        missing, extra = set(want) - set(state), set(state) - set(want)
        if missing or extra:
            raise ValueError(
                f"state dict mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
            )
        for name, shape in want.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(state[name].shape)}, expected {shape}")
        for name, p in self.dense_parameters().items():
            if name in VOCAB_ROWS:
                p[self.cfg.vocab_size :].zero_()
            self.unpadded(name, p).copy_(state[name])
        for layer, block in enumerate(self.layers):
            gu, dn = _expert_keys(layer)
            block.moe.experts.load_canonical(state[gu], state[dn])

    def set_local_experts(self, local_experts: list[int]) -> None:
        """Re-split every layer's experts (e.g. when the swarm assigns this peer its experts). Optimizer
        state must be rebuilt by the caller: parameter objects change."""
        state = self.canonical_state_dict()
        device = self.embed.weight.device
        self.local_experts = sorted(local_experts)
        for block in self.layers:
            block.moe = MoELayer(self.cfg, self.local_experts, self.frozen_dtype).to(device)
        self.load_canonical_state_dict(state)

    # -- bookkeeping --------------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def dense_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if ".experts." not in n}

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """Detached views of the dense weights at their canonical size (no vocabulary padding rows); an
        in-place update of a view reaches the model."""
        return {n: self.unpadded(n, p.detach()) for n, p in self.dense_parameters().items()}

    def unpadded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the parameter ``name``, or anything of its shape such as an optimizer moment) without
        the vocabulary padding rows; other tensors as they are."""
        return tensor[: self.cfg.vocab_size] if name in VOCAB_ROWS else tensor

    def padded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse of ``unpadded``: zero rows appended up to ``padded_vocab``."""
        if name not in VOCAB_ROWS or tensor.shape[0] == self.padded_vocab:
            return tensor
        pad = tensor.new_zeros(self.padded_vocab - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, pad])

    def local_expert_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if ".experts." in n}

    # -- compute ------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> ModelOutput:
        x = self.embed(input_ids)
        rope = self.rope(input_ids.shape[1], x.device, x.dtype)
        stats = []
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.layers:
            x, s = checkpoint(block, x, rope, use_reentrant=False) if recompute else block(x, rope)
            stats.append(s)
        h = self.norm(x)
        out = ModelOutput(logits=None, expert_tokens=routed_token_counts(stats, self.cfg.n_experts).detach())
        if targets is None:
            out.logits = self.lm_head(h)[..., : self.cfg.vocab_size]
            return out
        out.lm_loss = linear_cross_entropy(
            h.reshape(-1, h.shape[-1]),
            self.lm_head.weight,
            targets.reshape(-1),
            self.cfg.vocab_size,
            self.loss_chunk_tokens,
        )
        out.lb_loss = load_balancing_loss(stats, self.cfg.n_experts)
        out.z_loss = router_z_loss(stats)
        out.loss = out.lm_loss + self.cfg.lb_loss_coef * out.lb_loss + self.cfg.z_loss_coef * out.z_loss
        return out
