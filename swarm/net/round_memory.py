"""Host memory of one round, by arithmetic from the model shape (``benchmarks/memory.py`` prints it).

A round holds on the host, until the training thread applies it:
  - snapshots s of the tensors it averages: the dense weights and the local experts, fp32;
  - the averaged results a of the same tensors, fp32;
  - downloaded non-local experts, as they came off the wire (fp16).
Non-local experts are read in place (one tensor at a time, for checks and the merge warm-up), never copied
whole. Besides the round, each averaging group keeps one fp32 host buffer of its tensors for as long as the
peer runs (hivemind's averager shares it with its process; the dense group also serves from it between
rounds), and the expert server an fp16 copy of each local expert (with a lossy codec also its fp32 change,
and with ``sync.lagged_refresh`` a second fp16 copy, staged, of each replicated one: not counted here);
those are listed separately.

    parts = round_host_bytes(cfg.model, n_local=4)
    parts.round_total, parts.averager_buffers
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config import ModelConfig

FP32, WIRE = 4, 2  # bytes per element: host fp32 tensors, and non-local experts on the wire (fp16)


def dense_elements(cfg: ModelConfig) -> int:
    """Elements of the dense weights at canonical size (embedding, LM head unless tied, attention, norms,
    routers)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    qk_norm = {"full": cfg.d_model + kv, "per_head": 2 * cfg.head_dim, "none": 0}[cfg.qk_norm]
    per_layer = 2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * kv + qk_norm + 2 * cfg.d_model
    per_layer += cfg.n_experts * cfg.d_model  # router
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.vocab_size * cfg.d_model + head + cfg.n_layers * per_layer + cfg.d_model


def expert_elements(cfg: ModelConfig) -> int:
    """Elements of one expert in every layer (gate, up, down)."""
    return cfg.n_layers * 3 * cfg.expert_hidden * cfg.d_model


@dataclass(frozen=True)
class RoundHostBytes:
    snapshots: int
    results: int
    downloads: int
    averager_buffers: int
    served_copies: int  # the expert server's fp16 copies of the local experts
    frozen_snapshot_before: int  # what the round used to hold besides: an fp32 copy of every non-local expert
    downloads_fp32_before: int  # and its downloads converted to fp32

    @property
    def round_total(self) -> int:
        return self.snapshots + self.results + self.downloads

    @property
    def round_total_before(self) -> int:
        return self.snapshots + self.results + self.frozen_snapshot_before + self.downloads_fp32_before


def held_bytes(cfg: ModelConfig, n_local: int, averaged: int, downloaded: int, dense: bool = True) -> int:
    """What a round holds when ``averaged`` of its ``n_local`` experts (and the dense weights if ``dense``)
    came back averaged and ``downloaded`` non-local experts arrived: the ``host_bytes`` of a round record."""
    d, x = dense_elements(cfg), expert_elements(cfg)
    return FP32 * (d + n_local * x) + FP32 * (dense * d + averaged * x) + WIRE * downloaded * x


def round_host_bytes(cfg: ModelConfig, n_local: int) -> RoundHostBytes:
    averaged = dense_elements(cfg) + n_local * expert_elements(cfg)
    others = (cfg.n_experts - n_local) * expert_elements(cfg)
    return RoundHostBytes(
        snapshots=FP32 * averaged,
        results=FP32 * averaged,
        downloads=WIRE * others,
        averager_buffers=FP32 * averaged,
        served_copies=WIRE * n_local * expert_elements(cfg),
        frozen_snapshot_before=FP32 * others,
        downloads_fp32_before=FP32 * others,
    )
