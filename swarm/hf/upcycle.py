"""``swarm-upcycle``: a Mixture-of-Experts checkpoint grown from a dense Llama- or Qwen3-style HF model.

    swarm-upcycle qwen3-1.7b/ runs/up --experts 16 --top-k 2 --config configs/spes-1b.yaml \\
        --set data.path=data/qwen --noise-std 0.01 --noise-fraction 0.5
    swarm-peer --config runs/up/config.yaml --init-from runs/up --run-dir runs/up-train --solo
    swarm-export runs/up hf/up

Every expert of a layer starts as a copy of that layer's dense MLP (gate, up, down); attention, norms,
embeddings and head are copied as they are; the router starts at zero (``--router-std`` for a random one).
A zero router gives every expert the same probability, and the top-k weights are renormalised
(``norm_topk_prob: true``), so the k chosen copies get weight 1/k each and the MoE computes exactly the
dense model. The command compares both on a random batch and prints the max logit difference (an error
when it is not ~0 without noise; ``--no-verify`` skips this for models too large to hold twice).
``--noise-std s --noise-fraction f`` perturbs each copy independently: a random fraction f of its entries
gets Gaussian noise of std s times the std of the dense matrix, which breaks the symmetry between experts.

Llama (and Mistral without a sliding window) becomes ``model.qk_norm: none`` and exports as Mixtral;
Qwen3 keeps its per-head q/k norms (``qk_norm: per_head``) and exports as Qwen3-MoE. Refused with one
``error:`` line: biases (Qwen2's q/k/v), sliding windows, RoPE scaling, head_dim != hidden/heads.

The output directory is laid out like a run directory: ``config.yaml`` (model from the dense config, the
other sections from ``--config`` or the defaults, then ``--set``), ``checkpoints/step_00000000/`` and
``tokenizer/`` (the dense model's tokenizer files; ``data.tokenizer`` points there, so training data must
be prepared with it). Start training with ``--init-from``, not ``--resume``: it holds no data position.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

from swarm.config import ConfigError, RunConfig, config_from_dict, load_config, save_config
from swarm.hf.architectures import check_dense_attention
from swarm.hf.errors import HFError
from swarm.hf.init_from import read_hf_config
from swarm.model import MoETransformer
from swarm.train.checkpoint import save_checkpoint

EXIT_BAD_INPUT = 2
DENSE_TYPES = {"llama": "none", "mistral": "none", "qwen3": "per_head"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
}


def moe_model_section(hf, n_experts: int, top_k: int) -> dict:
    """The ``model`` section of the upcycled run, from the dense config (HFError if not representable)."""
    qk = DENSE_TYPES.get(hf.model_type)
    if qk is None:
        hint = (
            " (Qwen2 has q/k/v biases, which this model does not represent)"
            if "qwen2" in hf.model_type
            else ""
        )
        raise HFError(
            f"cannot upcycle model type {hf.model_type!r}{hint}; supported: {', '.join(DENSE_TYPES)}"
        )
    check_dense_attention(hf)
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise HFError(
            f"{hf.model_type}: RoPE scaling {rope['rope_type']!r} is not supported (only plain RoPE)"
        )
    return {
        "vocab_size": hf.vocab_size,
        "d_model": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_key_value_heads or hf.num_attention_heads,
        "n_experts": n_experts,
        "expert_hidden": hf.intermediate_size,
        "top_k": top_k,
        "norm_topk_prob": True,  # with a zero router: k equal weights summing to 1, i.e. the dense MLP
        "max_seq_len": hf.max_position_embeddings,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rms_norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "init_std": float(getattr(hf, "initializer_range", 0.02)),
        "qk_norm": qk,
    }


def _noisy_copies(w: torch.Tensor, n: int, std: float, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` copies of ``w``; with ``std > 0`` each gets N(0, (std * w.std())^2) on a random ``fraction``."""
    out = w.unsqueeze(0).repeat(n, *([1] * w.dim()))
    if std > 0 and fraction > 0:
        mask = torch.rand(out.shape, generator=gen) < fraction
        out += mask * torch.randn(out.shape, generator=gen) * (std * w.std())
    return out


def upcycle_state(
    dense: dict[str, torch.Tensor], cfg, noise_std=0.0, noise_fraction=1.0, router_std=0.0, seed=0
) -> dict[str, torch.Tensor]:
    """Canonical MoE tensors from a dense HF ``state_dict`` (fp32). HFError for a tensor with no place."""
    gen = torch.Generator().manual_seed(seed)
    dense = {k: v.detach().float() for k, v in dense.items()}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return dense[name]

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        for theirs, ours in _LAYER.items():
            if pre + theirs in dense:
                out[f"layers.{i}.{ours}"] = take(pre + theirs)
        gate_up = torch.cat([take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")], dim=0)
        out[f"layers.{i}.moe.experts.gate_up"] = _noisy_copies(
            gate_up, cfg.n_experts, noise_std, noise_fraction, gen
        )
        down = take(pre + "mlp.down_proj.weight")
        out[f"layers.{i}.moe.experts.down"] = _noisy_copies(
            down, cfg.n_experts, noise_std, noise_fraction, gen
        )
        out[f"layers.{i}.moe.gate.weight"] = (
            torch.randn(cfg.n_experts, cfg.d_model, generator=gen) * router_std
        )
    left = sorted(set(dense) - used)
    if left:
        raise HFError(f"dense tensor {left[0]} has no place in the MoE (unsupported architecture variant)")
    return out


@torch.no_grad()
def dense_parity(dense_model, state: dict[str, torch.Tensor], cfg) -> tuple[float, float]:
    """(max |logits(MoE) - logits(dense)|, max |logits(dense)|) on a fixed random batch."""
    moe = MoETransformer(cfg).eval()
    moe.load_canonical_state_dict(state)
    x = torch.randint(
        0, cfg.vocab_size, (2, min(32, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0)
    )
    want = dense_model.eval()(x).logits
    return (moe(x).logits - want).abs().max().item(), want.abs().max().item()


def upcycle(args: argparse.Namespace) -> tuple[Path, float | None]:
    from transformers import AutoModelForCausalLM

    src, out = Path(args.dense_dir), Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise HFError(f"{out} already exists and is not empty; choose another OUT_CHECKPOINT or pass --force")
    if not src.is_dir():
        raise HFError(f"{src} is not a directory")
    if not (0 <= args.noise_fraction <= 1) or args.noise_std < 0 or args.router_std < 0:
        raise ConfigError("--noise-fraction must be in [0, 1]; --noise-std and --router-std must be >= 0")
    hf = read_hf_config(src)
    base = load_config(args.config).to_dict() if args.config else RunConfig().to_dict()
    base["model"] = moe_model_section(hf, args.experts, args.top_k)
    if not args.config:  # the default windows may be longer than this model's context
        base["data"]["seq_len"] = min(base["data"]["seq_len"], base["model"]["max_seq_len"])
    tok_dir = out.resolve() / "tokenizer"
    has_tokenizer = (src / "tokenizer.json").is_file()
    if has_tokenizer:
        base["data"]["tokenizer"] = str(tok_dir / "tokenizer.json")
    cfg: RunConfig = config_from_dict(base, args.set)
    try:
        dense_model = AutoModelForCausalLM.from_pretrained(
            str(src), dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise HFError(f"cannot load the dense model in {src}: {e}") from None
    state = upcycle_state(
        dense_model.state_dict(), cfg.model, args.noise_std, args.noise_fraction, args.router_std, args.seed
    )
    diff, scale = (None, 0.0) if args.no_verify else dense_parity(dense_model, state, cfg.model)
    # fp32 op-order differences stay far below this; a mapping bug is of the order of the logits
    exact = args.noise_std == 0 and args.router_std == 0
    if diff is not None and exact and not diff <= 1e-3 * max(1.0, scale):
        raise HFError(f"upcycled model does not reproduce the dense one (max logit difference {diff:.3g})")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if has_tokenizer:
            (tmp / "tokenizer").mkdir()
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / "tokenizer" / name)
        save_config(cfg, tmp / "config.yaml")
        info = {
            "source": str(src.resolve()),
            "noise_std": args.noise_std,
            "noise_fraction": args.noise_fraction,
        }
        local = cfg.experts.resolve(cfg.model.n_experts)
        meta = {"tokens": 0, "fingerprint": cfg.fingerprint(), "run_id": cfg.run_id, "local_experts": local}
        save_checkpoint(tmp / "checkpoints", 0, state, {}, {**meta, "upcycled_from": info})
        if out.exists():  # --force: replace only now that the new one is complete
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not has_tokenizer:
        print(f"note: {src} has no tokenizer.json; set data.tokenizer in {out}/config.yaml", file=sys.stderr)
    return out, diff


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="swarm-upcycle", description="Build an MoE checkpoint from a dense HF model."
    )
    ap.add_argument("dense_dir", help="dense Llama / Mistral / Qwen3 model directory (config.json + weights)")
    ap.add_argument("out_dir", help="where to write config.yaml, checkpoints/ and tokenizer/")
    ap.add_argument("--experts", type=int, required=True, help="experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    ap.add_argument("--noise-std", type=float, default=0.0, help="noise std, relative to each matrix's std")
    ap.add_argument("--noise-fraction", type=float, default=1.0, help="fraction of entries that get noise")
    ap.add_argument("--router-std", type=float, default=0.0, help="router init std (default 0: zero router)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the noise")
    ap.add_argument(
        "--config", default=None, help="YAML preset for the non-model sections (default: defaults)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--force", action="store_true", help="replace OUT_CHECKPOINT if it exists")
    ap.add_argument("--no-verify", action="store_true", help="skip the logits check (it holds both models)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        out, diff = upcycle(args)
    except (HFError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    check = "not verified" if diff is None else f"max logit difference to the dense model {diff:.2e}"
    print(f"upcycled {args.dense_dir} into {out} ({check})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
