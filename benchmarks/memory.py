"""Training-state memory of a 4-of-16-experts peer relative to an all-experts peer: measured vs arithmetic.

What is measured
    The bytes a peer holds to train: parameters, gradients and AdamW moments, for the spes-1b widths and
    vocabulary (d_model 768, 16 SwiGLU experts of hidden 2048, vocabulary 151665) with fewer layers than the
    real 12 so that the all-experts peer fits this machine (``--layers``, default 4; the printout says how
    many). Three variants: all experts trainable; 4 of 16 trainable with the 12 frozen experts held in fp32;
    and the same with frozen experts in bf16.

How
    Each variant runs in its own subprocess so that its memory starts clean. The child imports everything,
    runs one tiny warm-up training step (so that lazily initialised library state, e.g. oneDNN/OpenMP
    buffers, is not counted), then records its resident set size (VmRSS from /proc/self/status), builds
    the model and the real optimizer (``swarm.train.optimizer.build_optimizer``), runs one real training
    step (batch 1, ``--seq`` tokens: the state size does not depend on it) and measures, with the
    gradients still held:

    (a) tensor bytes: ``swarm.train.memory.training_state_bytes`` over the model's parameters, buffers,
        gradients and optimizer state (distinct storages counted once);
    (b) RSS growth: VmRSS after the step, with the step's activations freed, minus VmRSS before building
        the model. glibc keeps freed heap memory mapped, so the child calls ``malloc_trim(0)`` (through
        ctypes) after ``gc.collect()`` before reading VmRSS. (b) sees memory that (a) cannot: a hidden
        copy of the weights kept by some module, a cache, an allocator that never returns memory.

    Prediction, from the shape alone (not from the model object), with E experts of which k are local:
        P_dense  = embeddings + LM head (once if tied) + per layer (q, k, v, o projections, q/k norms,
                   two block norms, router) + final norm
        P_expert = n_layers * 3 * expert_hidden * d_model          (one expert, all layers)
        all experts: 16 * (P_dense + E * P_expert)                   fp32 param + grad + 2 Adam moments
        k of E:      16 * (P_dense + k * P_expert) + (E - k) * P_expert * (4 for fp32 | 2 for bf16)
    plus AdamW's per-tensor ``step`` counters (one fp32 scalar per trainable tensor; included). Not
    predicted: the model's non-weight buffers (per layer an int64 routing index of E entries, and the RoPE
    frequency table); they appear as the few hundred bytes of "measured - predicted" in tensor accounting.

Goal: the measured ratio (4-of-16 bytes / all-experts bytes) within 5% of the predicted ratio.

Usage::

    python benchmarks/memory.py                 # spes-1b widths, 4 layers
    python benchmarks/memory.py --layers 2 --json
    python benchmarks/memory.py --tiny --json   # seconds; for the smoke test
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parent process never imports torch; each child does
    import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.config import ModelConfig, RunConfig, load_config  # noqa: E402
from swarm.net.round_memory import round_host_bytes  # noqa: E402

GOAL_REL_DIFF = 0.05
VARIANTS = ("all", "local-fp32", "local-bf16")  # all experts; k local with frozen experts in fp32 / bf16
TINY_OVERRIDES = [
    "model.vocab_size=1024",
    "model.d_model=64",
    "model.n_heads=4",
    "model.expert_hidden=64",
    "model.max_seq_len=64",
    "data.seq_len=64",
]


# -- prediction from the shape ---------------------------------------------------------------------------
@dataclass
class Prediction:
    dense_params: int  # P_dense
    expert_params: int  # P_expert: one expert over all layers
    trainable_tensors: int  # AdamW keeps one fp32 `step` scalar per trainable tensor


def predict_shape(cfg: ModelConfig) -> Prediction:
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = (
        d * d  # q_proj
        + d * kv  # k_proj
        + d * kv  # v_proj
        + d * d  # o_proj
        + d  # q_norm
        + kv  # k_norm
        + 2 * d  # attn_norm, ffn_norm
        + cfg.n_experts * d  # router
    )
    embed = -(-cfg.vocab_size // 128) * 128 * d  # the model pads the vocabulary to 128 rows (VOCAB_PAD)
    dense = embed + (0 if cfg.tie_embeddings else embed) + cfg.n_layers * per_layer + d  # + final norm
    expert = cfg.n_layers * 3 * cfg.expert_hidden * d
    # trainable tensors: embed, [lm_head], final norm; per layer 9 dense (4 projections, 2 q/k norms,
    # 2 block norms, router) and the local expert bank (gate_up, down)
    top = 2 if cfg.tie_embeddings else 3
    return Prediction(dense, expert, top + cfg.n_layers * (9 + 2))


def predicted_bytes(p: Prediction, n_experts: int, k: int, frozen_bytes: int) -> int:
    trained = 16 * (p.dense_params + k * p.expert_params)  # param + grad + exp_avg + exp_avg_sq, fp32
    frozen = (n_experts - k) * p.expert_params * frozen_bytes
    return trained + frozen + 4 * p.trainable_tensors


# -- the child: one variant in a clean process ------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def release_freed_memory() -> bool:
    """gc, then ask glibc to return free heap pages to the OS. Returns whether malloc_trim was available."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def train_one_step(model: torch.nn.Module, cfg: RunConfig, seq: int) -> torch.optim.Optimizer:
    """Build the real optimizer and run one training step; gradients stay allocated (no zero_grad)."""
    import torch

    from swarm.train.optimizer import build_optimizer

    opt = build_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=gen)
    out = model(x[:, :-1], targets=x[:, 1:])
    out.loss.backward()
    opt.step()
    del out, x
    return opt


def run_child(cfg: RunConfig, variant: str, k: int, seq: int) -> dict:
    import torch

    from swarm.model import MoETransformer
    from swarm.train.memory import training_state_bytes

    def build(model_cfg: ModelConfig) -> MoETransformer:
        local = None if variant == "all" else list(range(k))
        frozen = "bfloat16" if variant == "local-bf16" else "float32"
        model = MoETransformer(model_cfg, local_experts=local, frozen_dtype=frozen)
        model.init_weights(seed=0)
        return model

    # warm-up on a tiny model of the same kind, so that library state created on first use is in the baseline
    tiny = ModelConfig(
        vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_experts=cfg.model.n_experts, expert_hidden=16
    )
    warm = build(tiny)
    opt = train_one_step(warm, RunConfig(model=tiny), seq=seq)
    del warm, opt
    trimmed = release_freed_memory()
    rss_before = rss_bytes()

    model = build(cfg.model)
    opt = train_one_step(model, cfg, seq)
    release_freed_memory()
    rss_after = rss_bytes()
    state = training_state_bytes(model, opt)
    assert all(p.grad is not None for p in model.trainable_parameters()), "gradients must be held"
    return {
        "variant": variant,
        "tensor_bytes": state["total"],
        "tensor_breakdown": state,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "rss_growth": rss_after - rss_before,
        "malloc_trim": trimmed,
        "threads": torch.get_num_threads(),
    }


# -- the parent: run the children, compare ------------------------------------------------------------------
def round_host_table(n_local: int) -> dict[str, dict[str, int]]:
    """A round's host bytes at the real spes-1b and spes-7b shapes, now and before non-local experts were
    read in place (see swarm/net/round_memory.py)."""
    out = {}
    for name in ("spes-1b", "spes-7b"):
        parts = round_host_bytes(load_config(ROOT / "configs" / f"{name}.yaml").model, n_local)
        out[name] = asdict(parts) | {
            "round_total": parts.round_total,
            "round_total_before": parts.round_total_before,
        }
    return out


def rel_diff(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted


def gib(n: float) -> str:
    return f"{n / 2**30:8.3f} GiB"


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(ROOT / "configs" / "spes-1b.yaml"), help="model preset (YAML)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (spes-1b has 12; default 4)")
    ap.add_argument("--local", type=int, default=4, help="experts a peer trains (default 4 of 16)")
    ap.add_argument("--seq", type=int, default=64, help="tokens of the one training step (batch 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads in each child (default: torch's)"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke tests): vocab 1024, d_model 64")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def load_run_config(args: argparse.Namespace) -> RunConfig:
    overrides = [f"model.n_layers={args.layers}"] + (TINY_OVERRIDES if args.tiny else []) + list(args.set)
    cfg = load_config(args.config, overrides=overrides)
    if not 1 <= args.local < cfg.model.n_experts:
        raise SystemExit(f"--local must be in [1, {cfg.model.n_experts - 1}]")
    if args.seq < 1 or args.seq > cfg.model.max_seq_len:
        raise SystemExit(f"--seq must be in [1, {cfg.model.max_seq_len}]")
    return cfg


def spawn(variant: str, argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", variant]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"variant {variant}: child process failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cfg = load_run_config(args)
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(run_child(cfg, args.child, args.local, args.seq)))
        return 0

    m, k = cfg.model, args.local
    shape = predict_shape(m)
    predicted = {
        "all": predicted_bytes(shape, m.n_experts, m.n_experts, 4),
        "local-fp32": predicted_bytes(shape, m.n_experts, k, 4),
        "local-bf16": predicted_bytes(shape, m.n_experts, k, 2),
    }
    avail = mem_available()
    if avail is not None and predicted["all"] * 1.5 > avail:
        raise SystemExit(
            f"the all-experts peer needs about {predicted['all'] * 1.5 / 2**30:.1f} GiB at its peak, "
            f"{avail / 2**30:.1f} GiB is available: use fewer --layers"
        )

    t0 = time.perf_counter()
    child_argv = [a for a in argv if a != "--json"]
    measured = {v: spawn(v, child_argv) for v in VARIANTS}

    rows = []
    for v in VARIANTS:
        rows.append(
            {
                "variant": v,
                "predicted_bytes": predicted[v],
                "tensor_bytes": measured[v]["tensor_bytes"],
                "rss_bytes": measured[v]["rss_growth"],
                "tensor_vs_predicted": rel_diff(measured[v]["tensor_bytes"], predicted[v]),
                "rss_vs_predicted": rel_diff(measured[v]["rss_growth"], predicted[v]),
            }
        )
    ratios = []
    for v in VARIANTS[1:]:
        pred = predicted[v] / predicted["all"]
        tensor = measured[v]["tensor_bytes"] / measured["all"]["tensor_bytes"]
        rss = measured[v]["rss_growth"] / measured["all"]["rss_growth"]
        ratios.append(
            {
                "variant": v,
                "frozen_dtype": "bfloat16" if v.endswith("bf16") else "float32",
                "predicted": pred,
                "tensor": tensor,
                "rss": rss,
                "tensor_rel_diff": rel_diff(tensor, pred),
                "rss_rel_diff": rel_diff(rss, pred),
                "tensor_pass": abs(rel_diff(tensor, pred)) <= GOAL_REL_DIFF,
                "rss_pass": abs(rel_diff(rss, pred)) <= GOAL_REL_DIFF,
            }
        )
    result = {
        "config": args.config,
        "shape": {
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "vocab_size": m.vocab_size,
            "n_experts": m.n_experts,
            "expert_hidden": m.expert_hidden,
            "local_experts": k,
            "seq": args.seq,
        },
        "prediction": asdict(shape),
        "goal_rel_diff": GOAL_REL_DIFF,
        "rows": rows,
        "ratios": ratios,
        "children": measured,
        "passed": all(r["tensor_pass"] and r["rss_pass"] for r in ratios),
        "round_host_bytes": round_host_table(args.local),
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


def print_report(r: dict) -> None:
    s = r["shape"]
    p = r["prediction"]
    print(
        f"Training-state memory: {s['local_experts']}-of-{s['n_experts']}-experts peer vs all-experts peer\n"
        f"shape: {r['config']} with n_layers={s['n_layers']} (of 12 in spes-1b), d_model={s['d_model']}, "
        f"vocab={s['vocab_size']}, {s['n_experts']} experts x SwiGLU hidden {s['expert_hidden']}\n"
        f"P_dense={p['dense_params']:,}  P_expert (one expert, all layers)={p['expert_params']:,}\n"
        f"one training step: batch 1 x {s['seq']} tokens, real AdamW; gradients held while measuring\n"
        f"measured (tensor) = training_state_bytes(model, optimizer); measured (RSS) = VmRSS growth "
        f"after gc + malloc_trim\n"
    )
    print(
        f"{'variant':<12} {'predicted':>14} {'tensor':>14} {'tensor-pred':>12} {'RSS growth':>14} {'RSS/pred':>9}"
    )
    for row in r["rows"]:
        print(
            f"{row['variant']:<12} {gib(row['predicted_bytes']):>14} {gib(row['tensor_bytes']):>14} "
            f"{row['tensor_bytes'] - row['predicted_bytes']:>10d} B {gib(row['rss_bytes']):>14} "
            f"{row['rss_vs_predicted']:>+8.2%}"
        )
    print(f"\nratio to all-experts (goal: measured within {r['goal_rel_diff']:.0%} of predicted)")
    print(
        f"{'frozen experts':<15} {'predicted':>10} {'tensor':>8} {'diff':>8} {'RSS':>8} {'diff':>8}  verdict"
    )
    for q in r["ratios"]:
        ok = "PASS" if q["tensor_pass"] and q["rss_pass"] else "FAIL"
        print(
            f"{q['frozen_dtype']:<15} {q['predicted']:>10.4f} {q['tensor']:>8.4f} {q['tensor_rel_diff']:>+8.2%} "
            f"{q['rss']:>8.4f} {q['rss_rel_diff']:>+8.2%}  {ok}"
        )
    print(f"\noverall: {'PASS' if r['passed'] else 'FAIL'}  ({r['seconds']:.0f} s)")
    print(
        f"\nHost memory of one round ({s['local_experts']} local experts; arithmetic from the full 12/32-layer "
        "shapes, swarm/net/round_memory.py;\nthe swarm's round records report the same count as host_bytes, "
        "checked against this formula by tests/test_round_memory.py)"
    )
    print(
        f"{'config':<8} {'snapshots':>10} {'results':>10} {'downloads':>10} {'round':>10} {'before':>10} "
        f"{'averager buffers':>17} {'served copies':>14}"
    )
    for name, b in r["round_host_bytes"].items():
        print(
            f"{name:<8} {gib(b['snapshots']):>10} {gib(b['results']):>10} {gib(b['downloads']):>10} "
            f"{gib(b['round_total']):>10} {gib(b['round_total_before']):>10} {gib(b['averager_buffers']):>17} "
            f"{gib(b['served_copies']):>14}"
        )


if __name__ == "__main__":
    sys.exit(main())
