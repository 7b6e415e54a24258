"""Which Hugging Face MoE class computes the same function as our model, and the configs both ways.

Usage::

    hf_cfg = hf_config_for(cfg.model, eos_token_id=0)     # OlmoeConfig / Qwen3MoeConfig / MixtralConfig
    cfg_model = model_config_from_hf(AutoConfig.from_pretrained(path))
    diffs = model_differences(run_cfg.model, cfg_model)   # [] when the weights are interchangeable

Our transformer is OLMoE's math with one choice left open, the q/k norm (``model.qk_norm``):
``full`` is OLMoE, ``per_head`` is Qwen3-MoE (models upcycled from Qwen3) and ``none`` is Mixtral (models
upcycled from Llama). All three HF classes keep the same tensor names in memory (fused experts
``mlp.experts.gate_up_proj``/``down_proj``, router ``mlp.gate``), so one renaming serves all of them;
``save_pretrained`` writes each family's usual file layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from swarm.config import ConfigError, ModelConfig
from swarm.hf.errors import HFError
from swarm.model.hf_olmoe import from_olmoe_state_dict, hf_common_kwargs, olmoe_config, to_olmoe_state_dict

# Fields that decide what function the weights compute; the rest (init_std, loss coefficients, backend,
# max_seq_len: RoPE is computed on the fly) may differ between a source of weights and a run.
MATH_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "n_experts",
    "expert_hidden",
    "top_k",
    "norm_topk_prob",
    "rope_theta",
    "rms_norm_eps",
    "tie_embeddings",
    "qk_norm",
)
ARCHITECTURES = {"full": "OlmoeForCausalLM", "per_head": "Qwen3MoeForCausalLM", "none": "MixtralForCausalLM"}


def hf_config_for(cfg: ModelConfig, **extra: Any):
    """The HF config of the class that computes what ``cfg`` computes. HFError when none does."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if cfg.qk_norm == "full":
        return olmoe_config(cfg, **extra)
    common = hf_common_kwargs(cfg) | extra
    if cfg.qk_norm == "per_head":
        return Qwen3MoeConfig(
            **common,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.expert_hidden,  # the dense MLP width; unused: every layer is sparse
            moe_intermediate_size=cfg.expert_hidden,
            num_experts=cfg.n_experts,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            attention_bias=False,
        )
    if not cfg.norm_topk_prob:
        raise HFError(
            "a model without q/k norms exports as Mixtral, which always renormalises the top-k router "
            "weights: it needs model.norm_topk_prob: true"
        )
    return MixtralConfig(
        **common,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.expert_hidden,
        num_local_experts=cfg.n_experts,
        sliding_window=None,
    )


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise HFError(what)


def _rope_theta(hf: Any) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    _require(kind == "default", f"RoPE scaling {kind!r} is not supported (only plain RoPE)")
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def check_dense_attention(hf: Any) -> None:
    """Refuse what our attention cannot compute: biases, sliding windows, odd head dims, other activations."""
    name = hf.model_type
    _require(
        getattr(hf, "hidden_act", "silu") == "silu", f"{name}: activation {hf.hidden_act!r} is not SwiGLU"
    )
    _require(
        not getattr(hf, "attention_bias", False) and name not in ("qwen2", "qwen2_moe"),
        f"{name}: attention has q/k/v biases, which this model does not represent",
    )
    _require(not getattr(hf, "mlp_bias", False), f"{name}: MLP biases are not supported")
    _require(getattr(hf, "clip_qkv", None) is None, f"{name}: clip_qkv is not supported")
    _require(
        not getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None) is None,
        f"{name}: sliding-window attention is not supported",
    )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    _require(
        head_dim * hf.num_attention_heads == hf.hidden_size,
        f"{name}: head_dim {head_dim} x {hf.num_attention_heads} heads != hidden_size {hf.hidden_size} "
        "(this model needs head_dim = hidden_size / num_attention_heads)",
    )


def model_config_from_hf(hf: Any) -> ModelConfig:
    """Our ModelConfig for a HF OLMoE / Qwen3-MoE / Mixtral config. HFError for anything else."""
    kind = {"olmoe": "full", "qwen3_moe": "per_head", "mixtral": "none"}.get(hf.model_type)
    _require(
        kind is not None,
        f"model type {hf.model_type!r} is not one swarm can load (supported: olmoe, qwen3_moe, mixtral)",
    )
    check_dense_attention(hf)
    if kind == "per_head":
        _require(
            hf.decoder_sparse_step == 1 and not hf.mlp_only_layers,
            "qwen3_moe: dense (mlp_only) layers are not supported: every layer must be sparse",
        )
        n_experts, hidden, norm_topk = hf.num_experts, hf.moe_intermediate_size, hf.norm_topk_prob
    elif kind == "none":
        n_experts, hidden, norm_topk = hf.num_local_experts, hf.intermediate_size, True
    else:
        n_experts, hidden, norm_topk = hf.num_experts, hf.intermediate_size, hf.norm_topk_prob
    try:
        return ModelConfig(
            vocab_size=hf.vocab_size,
            d_model=hf.hidden_size,
            n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads,
            n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            n_experts=n_experts,
            expert_hidden=hidden,
            top_k=hf.num_experts_per_tok,
            norm_topk_prob=bool(norm_topk),
            max_seq_len=hf.max_position_embeddings,
            rope_theta=_rope_theta(hf),
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qk_norm=kind,
        )
    except ConfigError as e:
        raise HFError(f"{hf.model_type} config cannot be represented: {e}") from None


def model_differences(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """``field: ours vs theirs`` for every math field that differs (empty: weights interchangeable)."""
    a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in MATH_FIELDS if a[k] != b[k]]


def to_hf_state_dict(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors under the in-memory names of the HF class (the same for all three)."""
    return to_olmoe_state_dict(canonical)


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical fp32 tensors from a HF model's ``state_dict()`` (buffers and a tied head dropped)."""
    keep = {
        k: v
        for k, v in hf_state.items()
        if k.startswith("model.layers.") or k in ("model.embed_tokens.weight", "model.norm.weight")
    }
    if not cfg.tie_embeddings and "lm_head.weight" in hf_state:
        keep["lm_head.weight"] = hf_state["lm_head.weight"]
    try:
        out = from_olmoe_state_dict(keep)
    except (KeyError, ValueError) as e:
        raise HFError(f"unexpected tensor name in the HF model: {e}") from None
    return {k: v.detach().float().contiguous() for k, v in out.items()}
