"""Mapping between our canonical weights and Hugging Face ``OlmoeForCausalLM``.

Export is a renaming of tensors: our model has the same math as OLMoE. The full ``swarm-export`` command
builds on these two functions.
"""

from __future__ import annotations

import torch

from swarm.config import ModelConfig

_LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "moe.gate.weight": "mlp.gate.weight",
    "moe.experts.gate_up": "mlp.experts.gate_up_proj",
    "moe.experts.down": "mlp.experts.down_proj",
}
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_common_kwargs(cfg: ModelConfig) -> dict:
    """The HF config fields that every MoE class we export to (OLMoE, Qwen3-MoE, Mixtral) names alike."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        num_experts_per_tok=cfg.top_k,
        tie_word_embeddings=cfg.tie_embeddings,
        router_aux_loss_coef=cfg.lb_loss_coef,
        initializer_range=cfg.init_std,
    )


def olmoe_config(cfg: ModelConfig, **extra):
    """An ``OlmoeConfig`` with the same shape as ``cfg`` (transformers is imported only here)."""
    from transformers import OlmoeConfig

    return OlmoeConfig(
        **hf_common_kwargs(cfg),
        intermediate_size=cfg.expert_hidden,
        num_experts=cfg.n_experts,
        norm_topk_prob=cfg.norm_topk_prob,
        **extra,
    )


def to_olmoe_state_dict(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename canonical tensors to OLMoE's in-memory (fused expert) names."""
    out = {}
    if "lm_head.weight" not in canonical:  # tied embeddings: HF still lists the (shared) head
        canonical = {**canonical, "lm_head.weight": canonical["embed.weight"]}
    for name, t in canonical.items():
        if name in _TOP_RENAMES:
            out[_TOP_RENAMES[name]] = t
            continue
        _, layer, rest = name.split(".", 2)
        out[f"model.layers.{layer}.{_LAYER_RENAMES[rest]}"] = t
    return out


def from_olmoe_state_dict(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_olmoe_state_dict`` (fused-expert layout)."""
    top = {v: k for k, v in _TOP_RENAMES.items()}
    layer_names = {v: k for k, v in _LAYER_RENAMES.items()}
    out = {}
    for name, t in hf.items():
        if name in top:
            out[top[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        out[f"layers.{layer}.{layer_names[rest]}"] = t
    return out
