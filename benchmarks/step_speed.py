"""Training-step time of our MoE against Hugging Face OLMoE, and of a 4-of-16-experts peer against an all-experts one.

What is measured
    One training step = forward with the loss (language modelling plus the load-balancing loss; ours also
    adds its 0.001 * router z-loss), backward, ``AdamW.step()`` and ``zero_grad()``. Variants, all built in
    this one process from the same weights and timed on the same batch, shape and thread count:

    ours-all     ``MoETransformer`` with every expert trainable
    ours-4of16   ``MoETransformer`` training experts 0-3; the 12 others are frozen fp32 buffers, so their
                 grouped GEMMs compute input gradients only and AdamW updates fewer tensors
    hf-olmoe     ``transformers.OlmoeForCausalLM`` with ``experts_implementation="grouped_mm"`` (checked:
                 the config says so and an op count shows ``aten._grouped_mm`` calls and no fallback),
                 ``output_router_logits=True`` (so its loss includes the load-balancing term) and
                 ``use_cache=False``
    ours-4of16-bf16  (``--bf16-frozen``) as ours-4of16 with frozen experts held in bf16

    Both models see the same input of ``seq`` tokens: HF shifts ``labels=input_ids`` internally; ours gets
    ``targets`` = the input shifted left by one with -100 (ignored) at the end, so each computes logits for
    ``seq`` positions and the same loss. AdamW has our hyper-parameters for both (``build_optimizer``:
    decay on matrices only, ``foreach=True``).

How
    Warm-up steps first, then ``--rounds`` rounds; in each round every variant runs ``--settle`` untimed
    steps and then one timed step, in an order rotated from round to round, so that slow phases of a
    shared, noisy machine hit all variants alike. The report gives the median step time per variant (with
    its forward / backward / optimizer split and page faults), the ratios of medians (what the goals are
    judged on) and, as cross-checks, the median of the per-round ratios and the ratio of the fastest steps.

    Allocator: torch has no caching allocator on CPU. With glibc's defaults every step mmaps and
    page-faults fresh memory for gradients, AdamW's temporaries and activations (about 1.9 GB per
    all-experts step at the default shape), and on the VM this was written on the cost of those faults
    varied two- to three-fold from step to step and with what ran before (an all-experts step right after a
    4-of-16 step was 40-75% slower), enough to flip the ours / HF comparison between runs. So the script
    keeps freed memory in the process (``swarm.train.cpu_allocator.keep_freed_memory``: glibc mallopt, no
    mmap, no trimming; the peer does the same on CPU) unless ``--system-malloc`` is given; and the settle step makes
    every timed step follow a step of the same variant, as in real training.

Goals: ours-all / hf-olmoe <= 1.1;  ours-4of16 / ours-all <= 0.9.

Default shape: spes-1b widths (d_model 768, 12 heads, 16 experts of SwiGLU hidden 2048, top-2) with 2
layers, vocabulary 32768 (not 151665, so that the LM head does not dominate a 2-layer model), batch 1 x 512
tokens, 2 threads. ``--preset demo`` uses configs/demo.yaml as it is (its micro-batch and sequence length).

Usage::

    python benchmarks/step_speed.py
    python benchmarks/step_speed.py --vocab 151665 --rounds 9 --bf16-frozen
    python benchmarks/step_speed.py --preset demo --json
    python benchmarks/step_speed.py --tiny --json    # seconds; for the smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.op_count import check_hf_grouped_mm, expert_ops  # noqa: E402
from swarm.config import RunConfig, load_config  # noqa: E402
from swarm.model import MoETransformer  # noqa: E402
from swarm.model.hf_olmoe import olmoe_config, to_olmoe_state_dict  # noqa: E402
from swarm.train.cpu_allocator import keep_freed_memory  # noqa: E402
from swarm.train.optimizer import build_optimizer  # noqa: E402

GOAL_VS_HF = 1.1
GOAL_LOCAL_VS_ALL = 0.9
PRESETS = {
    # config file, default overrides of the shape (None: keep the file's value)
    "spes-1b": {"config": "configs/spes-1b.yaml", "layers": 2, "vocab": 32768, "batch": 1, "seq": 512},
    "demo": {"config": "configs/demo.yaml", "layers": None, "vocab": None, "batch": None, "seq": None},
}
TINY_OVERRIDES = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_heads=4",
    "model.expert_hidden=64",
    "model.max_seq_len=64",
    "data.seq_len=64",
]


# -- the variants ----------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[], torch.Tensor]
    times: list[float] = field(default_factory=list)  # whole step, seconds
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # forward, backward, optimizer
    page_faults: list[int] = field(default_factory=list)  # minor page faults of the process during the step

    def step(self) -> tuple[float, float, float, int]:
        """One training step; returns forward, backward and optimizer seconds and the page faults taken."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = self.loss_fn()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        t3 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return t1 - t0, t2 - t1, t3 - t2, faults


def adamw_like_ours(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    """The optimizer ``build_optimizer`` gives our model, for another model: AdamW, decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    t = cfg.train
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, foreach=True)


def build_variants(cfg: RunConfig, args: argparse.Namespace, x: torch.Tensor) -> tuple[list[Variant], float]:
    """ours-all, ours-kofE, [ours-kofE-bf16], hf-olmoe; and |HF loss - our lm + lb loss| on the batch."""
    from transformers import OlmoeForCausalLM

    m = cfg.model
    # HF shifts labels=input_ids internally; ours gets the shifted targets, -100 (ignored) at the end
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)

    def ours(local: list[int] | None, frozen: str) -> tuple[MoETransformer, Callable[[], torch.Tensor]]:
        model = MoETransformer(m, local_experts=local, frozen_dtype=frozen)
        model.init_weights(seed=0)
        return model, lambda: model(x, targets=targets).loss

    local = list(range(args.local))
    variants = []
    model, fn = ours(None, "float32")
    variants.append(Variant("ours-all", model, build_optimizer(model, cfg.train), fn))
    canonical = model.canonical_state_dict()
    model, fn = ours(local, "float32")
    variants.append(
        Variant(f"ours-{args.local}of{m.n_experts}", model, build_optimizer(model, cfg.train), fn)
    )
    if args.bf16_frozen:
        model, fn = ours(local, "bfloat16")
        name = f"ours-{args.local}of{m.n_experts}-bf16"
        variants.append(Variant(name, model, build_optimizer(model, cfg.train), fn))

    hf_cfg = olmoe_config(
        m, pad_token_id=None, eos_token_id=None, use_cache=False, experts_implementation="grouped_mm"
    )
    hf = OlmoeForCausalLM(hf_cfg)
    hf.load_state_dict(to_olmoe_state_dict(canonical), strict=True)
    del canonical
    hf.train()

    def hf_loss() -> torch.Tensor:
        return hf(input_ids=x, labels=x, output_router_logits=True, use_cache=False).loss

    variants.append(Variant("hf-olmoe", hf, adamw_like_ours(hf, cfg), hf_loss))
    with torch.no_grad():  # same weights, same batch: HF's loss is our lm + lb_coef * lb (no z-loss term)
        out = variants[0].model(x, targets=targets)
        ours_loss = (out.lm_loss + m.lb_loss_coef * out.lb_loss).item()
        difference = abs(ours_loss - hf_loss().item())
    return variants, difference


# -- timing --------------------------------------------------------------------------------------------------
def run_rounds(variants: list[Variant], warmup: int, rounds: int, settle: int) -> None:
    """``warmup`` untimed rounds, then ``rounds`` timed ones. In each round every variant runs ``settle``
    untimed steps and then one timed step, so that the timed step follows a step of the same variant as in
    real training (a step right after another variant's runs at a different speed: see the module doc)."""
    n = len(variants)
    for r in range(warmup + rounds):
        for i in range(n):
            v = variants[(i + r) % n]  # rotate the order every round
            for _ in range(settle if r >= warmup else 1):
                v.step()
            if r >= warmup:
                gc.collect()
                *phases, faults = v.step()
                v.phases.append(tuple(phases))
                v.times.append(sum(phases))
                v.page_faults.append(faults)


def summarize(v: Variant) -> dict:
    fwd, bwd, opt = zip(*v.phases, strict=True)
    return {
        "median_s": statistics.median(v.times),
        "min_s": min(v.times),
        "max_s": max(v.times),
        "forward_s": statistics.median(fwd),
        "backward_s": statistics.median(bwd),
        "optimizer_s": statistics.median(opt),
        "page_faults": int(statistics.median(v.page_faults)),
        "times_s": v.times,
    }


def ratio(a: Variant, b: Variant) -> dict:
    paired = [x / y for x, y in zip(a.times, b.times, strict=True)]
    return {
        "numerator": a.name,
        "denominator": b.name,
        "ratio_of_medians": statistics.median(a.times) / statistics.median(b.times),
        "median_of_round_ratios": statistics.median(paired),
        "ratio_of_minimums": min(a.times) / min(b.times),
    }


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="spes-1b", help="shape preset")
    ap.add_argument("--layers", type=int, help="transformer layers (spes-1b preset: 2)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (spes-1b preset: 32768)")
    ap.add_argument("--batch", type=int, help="sequences per step (spes-1b preset: 1)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (spes-1b preset: 512)")
    ap.add_argument("--local", type=int, default=4, help="experts the subset peer trains (default 4)")
    ap.add_argument("--bf16-frozen", action="store_true", help="also time the subset peer with bf16 frozen")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, one step per variant (default 5)")
    ap.add_argument(
        "--settle", type=int, default=1, help="untimed steps of a variant before its timed one (default 1)"
    )
    ap.add_argument(
        "--system-malloc",
        action="store_true",
        help="keep glibc's default allocator settings (default: restart with freed memory retained)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (smoke tests): vocab 512, d_model 64")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    return ap.parse_args(argv)


def resolve(args: argparse.Namespace) -> tuple[RunConfig, int, int]:
    preset = PRESETS[args.preset]
    layers = args.layers or preset["layers"]
    vocab = args.vocab or preset["vocab"]
    overrides = [f"model.n_layers={layers}"] if layers else []
    overrides += [f"model.vocab_size={vocab}"] if vocab else []
    overrides += (TINY_OVERRIDES if args.tiny else []) + list(args.set)
    cfg = load_config(ROOT / preset["config"], overrides=overrides)
    batch = args.batch or preset["batch"] or cfg.data.micro_batch
    seq = args.seq or preset["seq"] or cfg.data.seq_len
    if args.tiny:
        batch, seq = args.batch or 1, args.seq or 32
    if seq > cfg.model.max_seq_len:
        raise SystemExit(f"--seq {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if not 1 <= args.local < cfg.model.n_experts:
        raise SystemExit(f"--local must be in [1, {cfg.model.n_experts - 1}]")
    return cfg, batch, seq


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.system_malloc:
        keep_freed_memory()  # before any big allocation; see the module docstring
    cfg, batch, seq = resolve(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    m = cfg.model
    x = torch.randint(0, m.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    variants, loss_difference = build_variants(cfg, args, x)
    ours_all, ours_local, hf = variants[0], variants[1], variants[-1]

    ops = {v.name: expert_ops(v) for v in variants[:-1]}
    ops[hf.name] = check_hf_grouped_mm(hf, m.n_layers)

    run_rounds(variants, args.warmup, args.rounds, args.settle)
    result = {
        "preset": args.preset,
        "shape": {
            "n_layers": m.n_layers,
            "d_model": m.d_model,
            "n_heads": m.n_heads,
            "vocab_size": m.vocab_size,
            "n_experts": m.n_experts,
            "expert_hidden": m.expert_hidden,
            "top_k": m.top_k,
            "batch": batch,
            "seq": seq,
            "local_experts": args.local,
        },
        "threads": torch.get_num_threads(),
        "allocator": "system default" if args.system_malloc else "freed memory retained (mallopt)",
        "warmup": args.warmup,
        "rounds": args.rounds,
        "settle": args.settle,
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "hf_experts_implementation": hf.model.config._experts_implementation,
        "hf_attn_implementation": hf.model.config._attn_implementation,
        "expert_ops": ops,
        "loss_difference": loss_difference,
        "variants": {v.name: summarize(v) for v in variants},
        "ratios": {
            "ours_vs_hf": {**ratio(ours_all, hf), "goal": GOAL_VS_HF},
            "local_vs_all": {**ratio(ours_local, ours_all), "goal": GOAL_LOCAL_VS_ALL},
        },
        "seconds": time.perf_counter() - t0,
    }
    if args.bf16_frozen:
        result["ratios"]["local_bf16_vs_all"] = {**ratio(variants[2], ours_all), "goal": GOAL_LOCAL_VS_ALL}
    for r in result["ratios"].values():
        r["met"] = r["ratio_of_medians"] <= r["goal"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def print_report(r: dict) -> None:
    s = r["shape"]
    print(
        f"Training-step time (forward + loss, backward, AdamW step, zero_grad), preset {r['preset']}\n"
        f"shape: {s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, vocab {s['vocab_size']}, "
        f"{s['n_experts']} experts x SwiGLU hidden {s['expert_hidden']}, top-{s['top_k']}; "
        f"batch {s['batch']} x {s['seq']} tokens\n"
        f"threads {r['threads']}; {r['warmup']} warm-up + {r['rounds']} timed rounds, interleaved, "
        f"{r['settle']} untimed step(s) of a variant before its timed one; "
        f"torch {r['torch']}, transformers {r['transformers']}\nallocator: {r['allocator']}\n"
        f"HF OLMoE experts_implementation={r['hf_experts_implementation']}, "
        f"attention={r['hf_attn_implementation']}; expert GEMM ops per forward+backward: "
        + "; ".join(f"{k}: {v}" for k, v in r["expert_ops"].items())
        + f"\nloss check on the batch: |HF - ours (lm + lb)| = {r['loss_difference']:.2e}\n"
    )
    print(
        f"{'variant':<20} {'median':>9} {'min':>9} {'max':>9} {'forward':>9} {'backward':>9} {'AdamW':>9}"
        f" {'page faults':>12}"
    )
    for name, v in r["variants"].items():
        print(
            f"{name:<20} {v['median_s']:>8.3f}s {v['min_s']:>8.3f}s {v['max_s']:>8.3f}s "
            f"{v['forward_s']:>8.3f}s {v['backward_s']:>8.3f}s {v['optimizer_s']:>8.3f}s {v['page_faults']:>12,}"
        )
    print()
    for q in r["ratios"].values():
        verdict = "met" if q["met"] else "NOT met"
        print(
            f"{q['numerator'] + ' / ' + q['denominator']:<32} {q['ratio_of_medians']:.3f} "
            f"(round ratios: median {q['median_of_round_ratios']:.3f}; minimums {q['ratio_of_minimums']:.3f})"
            f"  goal <= {q['goal']}  {verdict}"
        )
    print(f"\n({r['seconds']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
