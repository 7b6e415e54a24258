"""Typed run configuration: nested dataclasses, validated on construction, loaded from YAML.

Usage::

    cfg = load_config("configs/demo.yaml", overrides=["train.lr=3e-4"])
    cfg.model.d_model, cfg.train.lr, cfg.experts.local

Every section validates itself in ``__post_init__`` and raises ``ConfigError`` with one line naming the
field, so a bad file or ``--set`` never gets as far as building a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from swarm.config_values import ConfigError, build, check


@dataclass
class ModelConfig:
    """Shape of the MoE transformer. Same math as Hugging Face OLMoE."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    n_experts: int = 16
    expert_hidden: int = 512  # SwiGLU hidden width of one expert
    top_k: int = 2
    norm_topk_prob: bool = False
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    lb_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    moe_backend: Literal["grouped_mm", "megablocks"] = "grouped_mm"
    # RMSNorm on queries and keys: "full" over the whole projection (OLMoE), "per_head" over each head
    # (Qwen3), "none" (Llama, Mixtral). The last two exist for models upcycled from dense checkpoints.
    qk_norm: Literal["full", "per_head", "none"] = "full"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "expert_hidden", "top_k"):
            check(getattr(self, name) >= 1, f"model.{name}", "must be >= 1")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check(self.d_model % self.n_heads == 0, "model.d_model", "must be divisible by model.n_heads")
        check(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", "must divide model.n_heads")
        check(self.head_dim % 2 == 0, "model.n_heads", "head dimension d_model/n_heads must be even (RoPE)")
        # grouped GEMM kernels need 16-byte aligned strides: a multiple of 8 covers fp32 and bf16.
        check(self.d_model % 8 == 0, "model.d_model", "must be a multiple of 8 (grouped GEMM alignment)")
        check(self.expert_hidden % 8 == 0, "model.expert_hidden", "must be a multiple of 8")
        check(self.top_k <= self.n_experts, "model.top_k", "must be <= model.n_experts")
        check(self.rope_theta > 0, "model.rope_theta", "must be > 0")
        check(self.lb_loss_coef >= 0 and self.z_loss_coef >= 0, "model.lb_loss_coef", "loss coefs >= 0")
        check(self.init_std > 0, "model.init_std", "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class ExpertsConfig:
    """Which experts this peer trains. ``local`` lists them; ``per_peer`` asks for a count that the swarm
    assigns when the peer joins (a solo peer takes the first ``per_peer``). Neither: train all experts."""

    local: list[int] | None = None
    per_peer: int | None = None
    frozen_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        check(
            self.local is None or self.per_peer is None,
            "experts.local",
            "give either experts.local or experts.per_peer, not both",
        )
        if self.local is not None:
            check(len(self.local) >= 1, "experts.local", "must not be empty")
            check(len(set(self.local)) == len(self.local), "experts.local", "has duplicates")
            check(all(e >= 0 for e in self.local), "experts.local", "expert indices must be >= 0")
        if self.per_peer is not None:
            check(self.per_peer >= 1, "experts.per_peer", "must be >= 1")

    def resolve(self, n_experts: int) -> list[int]:
        """The sorted expert indices a solo peer trains."""
        if self.local is not None:
            bad = [e for e in self.local if e >= n_experts]
            check(not bad, "experts.local", f"indices {bad} out of range for model.n_experts={n_experts}")
            return sorted(self.local)
        if self.per_peer is not None:
            check(self.per_peer <= n_experts, "experts.per_peer", f"must be <= model.n_experts={n_experts}")
            return list(range(self.per_peer))
        return list(range(n_experts))


@dataclass
class DataConfig:
    """Token data. ``path: stdlib`` builds the embedded corpus (the Python standard library) on first use."""

    path: str = "stdlib"
    tokenizer: str | None = None  # optional tokenizer.json; checked against the one the data was made with
    cache_dir: str | None = None  # where the stdlib corpus is built; default $SWARM_CACHE or ~/.cache/swarm
    stdlib_vocab_size: int = 4096
    seq_len: int = 256
    micro_batch: int = 8
    val_batches: int = 8
    seed: int | None = None  # window sampling seed; each peer should differ (None: train.seed + 1)

    def __post_init__(self) -> None:
        check(bool(self.path), "data.path", "must be a prepared data directory or 'stdlib'")
        check(self.seq_len >= 2, "data.seq_len", "must be >= 2")
        check(self.micro_batch >= 1, "data.micro_batch", "must be >= 1")
        check(self.val_batches >= 1, "data.val_batches", "must be >= 1")
        check(
            self.stdlib_vocab_size >= 260, "data.stdlib_vocab_size", "must be >= 260 (256 bytes + specials)"
        )


@dataclass
class TrainConfig:
    """Local optimisation: AdamW over trainable parameters, warm-up then cosine decay."""

    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2000
    decay_steps: int = 50000  # the cosine reaches min_lr_ratio * lr here and stays there
    max_steps: int = 50000
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    # the experts' learning rate as a multiple of the dense weights' (benchmarks/README.md, "Where the gap
    # comes from": 0.6 to 2 measured at the demo shape; 1 was as good as any)
    expert_lr_scale: float = 1.0
    grad_clip: float = 1.0
    grad_accum: int = 1
    # each peer's AdamW divides by the second moment of the swarm's pooled batch instead of its own batch's
    # (``swarm.train.pooled_moment``): its step's windows in two halves give the noise that the average
    # of the peers removes. The pools (peers for the dense weights, holders for an expert) come from the
    # swarm's view; a solo peer has a pool of 1, plain AdamW. Needs an even number of windows per step
    pooled_moment: bool = False
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    autocast_bf16: bool = True  # on CUDA only; CPU runs in fp32
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    compile: bool | None = None  # torch.compile the model; None: on for CUDA, off on CPU
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~1/3 more compute
    # the LM head and cross-entropy run over this many tokens at a time, so fp32 logits of the whole batch
    # never exist (0: one chunk, plain cross-entropy)
    loss_chunk_tokens: int = 1024
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 500
    # also a checkpoint once this many seconds have passed since the last one (0: by steps only), so that
    # a peer killed without warning loses minutes of training, not a run
    checkpoint_every_s: float = 120.0
    keep_checkpoints: int = 3
    # each step lasts at least this many seconds, the rest slept (0: off): a peer on a shared machine leaves
    # the CPU to others, and a benchmark's CPU peers leave it to their rounds, like peers that train on GPUs
    min_step_s: float = 0.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # YAML gives a list
        check(self.lr > 0, "train.lr", "must be > 0")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        check(self.decay_steps >= 1, "train.decay_steps", "must be >= 1")
        check(self.max_steps >= 0, "train.max_steps", "must be >= 0")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas", "two values in [0,1)"
        )
        check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        check(0 < self.expert_lr_scale <= 100, "train.expert_lr_scale", "must be in (0, 100]")
        check(self.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
        check(self.grad_accum >= 1, "train.grad_accum", "must be >= 1")
        check(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
            "train.device",
            "auto|cpu|cuda",
        )
        for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
            check(getattr(self, name) >= 1, f"train.{name}", "must be >= 1")
        check(self.loss_chunk_tokens >= 0, "train.loss_chunk_tokens", "must be >= 0 (0: no chunking)")
        check(self.checkpoint_every_s >= 0, "train.checkpoint_every_s", "must be >= 0 (0: by steps only)")
        check(0 <= self.min_step_s <= 60, "train.min_step_s", "must be in [0, 60] seconds (0: off)")


@dataclass
class SyncConfig:
    """How often and how strongly a peer synchronises with the swarm (used by the networked peer)."""

    sync_every: int = 100
    # > 0: rounds start when the wall clock passes a multiple of this many seconds, on every peer at once
    # (faster peers take more steps, which the token weights count), instead of every sync_every steps:
    # peers whose step counts drift apart still meet within one step's time, and form whole groups
    sync_every_s: float = 0.0
    # rounds on the wall clock only: an ordinary round's groups meet this many seconds (at most a quarter of
    # a slot, ``prematch_window_s``) before its slot, while the links are idle between rounds, and their
    # all-reduce begins at the slot. The weights count the tokens up to that meeting. 0: groups look for
    # their members at the slot (on H100 peers over 100 Mbit/s that was 1.45x the payload's link time per
    # int8 round, median, against 1.32x met early; benchmarks/README.md)
    prematch_s: float = 2.0
    # a round runs beside training and lands steps after its snapshot (theta + alpha (a - s)). False:
    # training waits for each ordinary round, at most its bound, and the next step starts from its result,
    # as in DiLoCo without streaming: no late landing, for the round's time. In process, averages landing 3
    # steps late cost 1.2% of the loss at the demo's spacing (benchmarks/README.md)
    overlap: bool = True
    # the outer learning rate: 1 with no momentum is plain averaging; above 1 the swarm's progress over a round
    # is extrapolated (averaging N peers' Adam steps moves noisy coordinates less than Adam on N batches)
    sync_alpha: float = 1.0
    outer_momentum: float = 0.0  # Nesterov outer momentum on (average - snapshot); 0 disables
    merge_warmup_steps: int = 0
    merge_every: int = 1
    merge_topk: int = 4
    merge_alpha: float = 0.5
    matchmaking_s: float = 5.0  # how long a round waits for partners to show up
    round_timeout_s: float = 60.0  # a round (matchmaking + all-reduce + checks) never takes longer
    download_timeout_s: float = 30.0
    heartbeat_s: float = 5.0  # records expire after 3 heartbeats
    join_settle_s: float = 3.0  # a joiner waits this long for simultaneous joiners before claiming experts
    orphan_grace_s: float = 60.0  # an expert with no live holder this long is re-claimed
    max_rel_distance: float = 4.0  # reject a received tensor farther than this x the norm of ours (garbage)
    # how averaged tensors travel (swarm.sync.codecs): fp32, fp16 or int8 (blockwise absmax). A lossy codec
    # sends the change since the last agreed state, plus what it dropped last round (error feedback). int8
    # by default: on GPU peers over 100 Mbit/s its rounds moved 0.15 of a fp32 full-model all-reduce, took
    # 1.25x their payload's link time, and learned no worse than fp32 (benchmarks/README.md). fp32 averages
    # exactly, for peers whose CPUs rather than links limit a round
    codec: Literal["fp32", "fp16", "int8", "int4"] = "int8"
    # the dense group's all-reduce (``dense_codec_name``); the expert groups and copies' changes use ``codec``
    dense_codec: Literal["", "fp32", "fp16", "int8", "int4"] = ""
    error_feedback: bool = True
    # non-local experts' copies are refreshed every this many sync points (the same ones on every peer)
    refresh_every: int = 1
    # the dense weights' rounds: at every this many sync points (the same ones on every peer) a round
    # averages all of them; at the others only the "core" ones, all but the token embeddings and output head
    # (attention, norms, routers: a fifth of the demo's dense bytes), in a group of their own. Their interval
    # is what costs, the embeddings' far less: in process, at equal bytes, the core every 3 steps and the
    # embeddings every 20 ended 1.0 to 1.8% below all of them every 10 over 4.6M tokens (benchmarks/README.md).
    # 1: every round averages all. Every peer of a swarm must use the same
    embeddings_every: int = 1
    # a refresh round's downloads begin once its groups have their members (True), not with the round:
    # on a narrow link they would otherwise queue matchmaking's messages behind the experts' copies
    downloads_after_matchmaking: bool = False
    # a refresh round serves (holders) and downloads (the others) the copies agreed in the round before,
    # from the round's start, instead of this round's once its groups are done: the downloads run alongside
    # the groups rather than after them, and non-local copies are one round older. Every peer of a swarm
    # must use the same
    lagged_refresh: bool = False
    # how members tell each other their round results' digests: "direct" (a message to each member) or
    # "dht" (records in the DHT, a lookup each way). Every peer of a swarm must use the same
    digests: Literal["direct", "dht"] = "direct"
    # how a group's contributions are combined (swarm.sync.robust_mean): "centered_trim" (and
    # "centered_clip") bound what a rogue member can do and weight every member equally; "mean" weights
    # members by their tokens and trusts them (closed swarms of peers you run yourself). Every peer of a
    # swarm must use the same rule
    aggregation: Literal["mean", "centered_clip", "centered_trim"] = "centered_trim"
    clip_factor: float = 2.0  # the robust rules' radius: this x the median member's distance from the centre

    def __post_init__(self) -> None:
        check(self.sync_every >= 1, "sync.sync_every", "must be >= 1")
        check(
            self.sync_every_s == 0 or self.sync_every_s >= 1, "sync.sync_every_s", "must be 0 (off) or >= 1"
        )
        check(0 <= self.prematch_s <= 60, "sync.prematch_s", "must be in [0, 60] seconds (0: off)")
        check(0 < self.sync_alpha <= 3, "sync.sync_alpha", "must be in (0, 3]")
        check(0 <= self.outer_momentum < 1, "sync.outer_momentum", "must be in [0, 1)")
        check(self.merge_warmup_steps >= 0, "sync.merge_warmup_steps", "must be >= 0")
        check(self.merge_every >= 1, "sync.merge_every", "must be >= 1")
        check(self.merge_topk >= 1, "sync.merge_topk", "must be >= 1")
        check(self.refresh_every >= 1, "sync.refresh_every", "must be >= 1")
        check(self.embeddings_every >= 1, "sync.embeddings_every", "must be >= 1")
        check(0 <= self.merge_alpha <= 1, "sync.merge_alpha", "must be in [0, 1]")
        for name in (
            "matchmaking_s",
            "round_timeout_s",
            "download_timeout_s",
            "heartbeat_s",
            "orphan_grace_s",
        ):
            check(getattr(self, name) > 0, f"sync.{name}", "must be > 0")
        check(
            self.round_timeout_s > self.matchmaking_s,
            "sync.round_timeout_s",
            "must exceed sync.matchmaking_s",
        )
        check(self.max_rel_distance > 0, "sync.max_rel_distance", "must be > 0")
        check(math.isfinite(self.clip_factor) and self.clip_factor >= 1, "sync.clip_factor", "must be >= 1")

    @property
    def dense_codec_name(self) -> str:
        """The dense all-reduce's codec: ``dense_codec``, or by default int4 with the int8 codec (with int8 for
        everything a round moves 0.17 of a full all-reduce where the dense weights are 30% of the model, as
        in the demo, and 0.136 with them in int4; averaged synchronously, int4 dense weights learned as fp32
        did, benchmarks/README.md) and ``codec`` itself with any other."""
        return self.dense_codec or ("int4" if self.codec == "int8" else self.codec)

    @property
    def prematch_window_s(self) -> float:
        """How long before its slot a round's groups meet: ``prematch_s``, at most a quarter of a slot (so a
        round that began at the slot before is usually over by then); 0 with rounds counted in steps."""
        return min(self.prematch_s, self.sync_every_s / 4) if self.sync_every_s > 0 else 0.0


@dataclass
class RunConfig:
    """One run: everything a peer needs. Peers of one swarm must agree on ``fingerprint()``."""

    run_id: str = "swarm"
    model: ModelConfig = field(default_factory=ModelConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self) -> None:
        check(bool(self.run_id) and "." not in self.run_id, "run_id", "must be non-empty and contain no '.'")
        check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len", "must be <= model.max_seq_len")
        self.experts.resolve(self.model.n_experts)  # range checks that need the model shape
        windows = self.data.micro_batch * self.train.grad_accum
        check(
            not self.train.pooled_moment or windows % 2 == 0,
            "train.pooled_moment",
            f"needs an even number of windows per step (data.micro_batch x train.grad_accum = {windows}); "
            "change one, or set train.pooled_moment=false",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of what must match across peers of one run: the model shape and the run id."""
        model = dataclasses.asdict(self.model)
        if model["qk_norm"] == "full":  # added later: the default leaves fingerprints of older runs unchanged
            del model["qk_norm"]
        blob = json.dumps({"run_id": self.run_id, "model": model}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _apply_override(raw: dict[str, Any], item: str) -> None:
    check("=" in item, "--set", f"expected key=value, got {item!r}")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        check(isinstance(node, dict), key, "is not a section")
    node[parts[-1]] = value


def config_from_dict(raw: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    raw = json.loads(json.dumps(raw))  # deep copy; also rejects non-JSON YAML oddities early
    for item in overrides or []:
        _apply_override(raw, item)
    return build(RunConfig, raw)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML preset, apply ``key=value`` overrides and validate. Raises ConfigError (one line)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML") from None
    if raw is None:
        raw = {}
    check(isinstance(raw, dict), str(path), "must be a YAML mapping of sections")
    try:
        return config_from_dict(raw, overrides)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path}: {e}") from None


def save_config(cfg: RunConfig, path: str | Path) -> None:
    data = cfg.to_dict()
    data["train"]["betas"] = list(data["train"]["betas"])
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
