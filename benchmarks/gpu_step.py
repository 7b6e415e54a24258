"""Training-step throughput, MFU and peak memory on one GPU: ours (all experts, 4 of 16) against HF OLMoE.

Rows (one process, one random batch, run one after another, each from freshly built state):
    ours-all          ``swarm.model.MoETransformer`` training every expert (fp32 weights, bf16 autocast)
    ours-4of16        the same training experts 0-3, the 12 others frozen in bf16 (a spes-1b peer)
    hf-olmoe          ``transformers.OlmoeForCausalLM`` held in bf16 (weights, gradients, AdamW state: its
                      grouped_mm casts inputs to the weights' dtype, so fp32 weights would run fp32 GEMMs),
                      ``experts_implementation="grouped_mm"`` (checked in its config)
    ours-4of16-mb-ac, ours-4of16-mb
                      the 4-of-16 peer at the config's micro-batch (spes-1b: 8 x 2048) with activation
                      checkpointing on / off: what a real peer needs (goal <= 24 GiB)

    A step is the trainer's: forward with the loss (ours lm + lb + z, HF lm + lb), backward,
    ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad()``, with its real pieces:
    ``MoETransformer(cfg.model, local, frozen_dtype, loss_chunk_tokens=..., activation_checkpointing=...)``,
    ``swarm.train.build_optimizer(model, cfg.train)``, ``model.compile()`` with ``--compile`` (default on
    CUDA). HF gets AdamW with our hyper-parameters and fused/foreach flags, and is compiled alike. A row
    whose compiled step fails is re-run eagerly and says so (``compile_error``). Per row: median of
    ``--steps`` timed steps after ``--warmup`` (device synchronised around each); tokens/s = batch * seq /
    median; MFU = tokens/s * FLOP per token / peak; peak = ``torch.cuda.max_memory_allocated()`` since
    ``reset_peak_memory_stats()`` once model and optimizer exist (weights, gradients, AdamW moments,
    activations); state = ``swarm.train.training_state_bytes`` (also on CPU, where peak is not measured).

    FLOP per token, the same model FLOPs for every row (a 4-of-16 peer skips its frozen experts' weight
    gradients yet is credited with the full model's work): ``flops_per_token`` = FLOPS_FORMULA =
        6 * N_active + 12 * n_layers * seq * d_model
        N_active = n_layers * (d_model * head_dim * (2 * n_heads + 2 * n_kv_heads)      q, k, v, o
                               + d_model * n_experts                                      router
                               + top_k * 3 * d_model * expert_hidden)                     SwiGLU experts
                   + d_model * vocab_size                                                 LM head
    (embeddings and norms are no matmuls; attention scores and values: 2 * 2 * seq * d_model per token and
    layer forward, x3 with backward, no causal discount.) Then ``benchmarks/gpu_round.py`` (a subprocess).

Usage::

    python benchmarks/gpu_step.py                       # on a CUDA machine: spes-1b shape, 4 x 2048
    python benchmarks/gpu_step.py --rows ours-all,hf-olmoe --steps 20 --no-compile
    python benchmarks/gpu_step.py --json                # one JSON object per line
    python benchmarks/gpu_step.py --device cpu --tiny --json --peak-tflops 1   # the smoke test, seconds

Without CUDA and without ``--device cpu`` it prints ``gpu_step: skipped: no CUDA device`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.config import ModelConfig, load_config  # noqa: E402
from swarm.model import MoETransformer  # noqa: E402
from swarm.model.hf_olmoe import olmoe_config, to_olmoe_state_dict  # noqa: E402
from swarm.train import build_optimizer, training_state_bytes  # noqa: E402

GIB = 2**30
MEM_GOAL_GIB = 24.0  # a 4-of-16 spes-1b peer at its micro-batch should fit a 24 GB card
RATIO_GOAL = 0.6  # 4-of-16 / all-experts peak memory
FLOPS_FORMULA = (
    "6 * N_active + 12 * n_layers * seq * d_model; N_active = n_layers * (d_model * head_dim * "
    "(2 * n_heads + 2 * n_kv_heads) + d_model * n_experts + top_k * 3 * d_model * expert_hidden) "
    "+ d_model * vocab_size"
)
TINY = [  # the smoke test's shape: every code path, seconds on 2 CPU cores
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.expert_hidden=64",
    "model.max_seq_len=64",
    "data.seq_len=32",
]
ROWS = ("ours-all", "ours-4of16", "hf-olmoe", "ours-4of16-mb-ac", "ours-4of16-mb")


def flops_per_token(m: ModelConfig, seq: int) -> int:
    """Training FLOP per token (forward + backward); the formula is FLOPS_FORMULA (module docstring)."""
    attn = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    n_active = m.n_layers * (attn + m.d_model * m.n_experts + m.top_k * 3 * m.d_model * m.expert_hidden)
    n_active += m.d_model * m.vocab_size
    return 6 * n_active + 12 * m.n_layers * seq * m.d_model


def device_peak_tflops(device: torch.device, given: float | None) -> tuple[float | None, str]:
    """bf16 dense peak TFLOP/s and where it came from: ``--peak-tflops``, else by the GPU's name."""
    if given:
        return given, "--peak-tflops"
    if device.type != "cuda":
        return None, "unknown for CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    if "H100" in name and "PCIe" in name:
        return 756.0, f"{name}: H100 PCIe bf16 dense"
    if "H100" in name or "H200" in name or "GH200" in name:
        return 989.0, f"{name}: H100/H200 SXM bf16 dense"
    return 989.0, f"{name}: not recognised, assuming H100 SXM (give --peak-tflops)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def adamw_like(ours: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.AdamW:
    """For HF: the optimizer ``build_optimizer`` gives ours (decay on matrices only, same flags)."""
    d = ours.defaults
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": ours.param_groups[0]["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    flags = {k: d[k] for k in ("foreach", "fused") if d.get(k) is not None}
    if flags.get("fused"):  # AdamW refuses both
        flags.pop("foreach", None)
    return torch.optim.AdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], **flags)


class Row:
    """One model + optimizer + batch; ``run`` times its steps and returns the row's record."""

    def __init__(self, name, cfg, canonical, device, batch, seq, args, local=None, ac=False) -> None:
        self.name, self.cfg, self.device, self.batch, self.seq = name, cfg, device, batch, seq
        self.hf = name == "hf-olmoe"
        self.canonical, self.args, self.local, self.ac = canonical, args, local, ac

    def build(self, compile_: bool):
        cfg, dev = self.cfg, self.device
        gen = torch.Generator().manual_seed(0)
        xy = torch.randint(0, cfg.model.vocab_size, (self.batch, self.seq + 1), generator=gen).to(dev)
        # both read seq tokens: ours predicts xy[:, 1:] as the trainer does; HF shifts labels=x itself
        x, y = xy[:, :-1], xy[:, 1:]
        if self.hf:
            from transformers import OlmoeForCausalLM

            hf_cfg = olmoe_config(
                cfg.model,
                pad_token_id=None,
                eos_token_id=None,
                use_cache=False,
                experts_implementation="grouped_mm",  # transformers 5.x: sets config._experts_implementation
            )
            with torch.device(dev):  # HF initialises its weights where they are made: fast on a GPU
                model = OlmoeForCausalLM(hf_cfg).to(torch.bfloat16)
            model.load_state_dict(to_olmoe_state_dict(self.canonical), strict=True)
            model.train()
            if model.config._experts_implementation != "grouped_mm":
                raise RuntimeError(f"HF runs experts_implementation={model.config._experts_implementation}")
            # our optimizer's flags on this device (build_optimizer may choose fused on CUDA), from a tiny model
            tiny = ModelConfig(vocab_size=64, d_model=8, n_layers=1, n_heads=1, n_experts=2, expert_hidden=8)
            opt = adamw_like(build_optimizer(MoETransformer(tiny, [0]).to(dev), cfg.train), model)
            loss = lambda: model(input_ids=x, labels=x, output_router_logits=True, use_cache=False).loss  # noqa: E731
        else:
            model = MoETransformer(
                cfg.model,
                self.local,
                "bfloat16" if self.local is not None else cfg.experts.frozen_dtype,
                loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                activation_checkpointing=self.ac,
            )
            model.load_canonical_state_dict(self.canonical)
            model.to(dev)
            opt = build_optimizer(model, cfg.train)
            loss = lambda: model(x, targets=y).loss  # noqa: E731
        if compile_:
            model.compile()
        return model, opt, loss

    def step(self, model, opt, loss_fn) -> torch.Tensor:
        with autocast(self.device, not self.hf):  # HF holds bf16 weights: its grouped_mm ignores autocast
            loss = loss_fn()
        loss.backward()
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        return loss.detach()

    def run(self, compile_: bool) -> dict:
        rec = {"kind": "row", "row": self.name, "batch": self.batch, "seq": self.seq, "compiled": compile_}
        rec |= {"local_experts": self.local, "activation_checkpointing": self.ac}
        try:
            return rec | self._measure(compile_)
        except Exception as e:  # OOM or a failed compile: report it; after a failed compile, run eagerly
            oom = isinstance(e, torch.OutOfMemoryError)
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        release(self.device)  # only out here: the traceback held the row's tensors
        if compile_ and not oom:
            torch._dynamo.reset()
            return self.run(False) | {"compile_error": err}
        return rec | {"error": err}

    def _measure(self, compile_: bool) -> dict:
        dev, a = self.device, self.args
        model, opt, loss_fn = self.build(compile_)
        release(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times, state = [], None
        for i in range(a.warmup + a.steps):
            sync(dev)
            t0 = time.perf_counter()
            loss = self.step(model, opt, loss_fn)
            sync(dev)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
            if i == 0:
                first = loss.item()
            if i == a.warmup + a.steps - 1:
                state = training_state_bytes(model, opt)["total"]  # gradients still held
            opt.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        med = statistics.median(times)
        tps = self.batch * self.seq / med
        out = {"median_step_s": med, "min_step_s": min(times), "tokens_per_s": tps, "loss_first": first}
        out.update(loss_last=loss.item(), peak_bytes=peak, state_bytes=state, step_times_s=times)
        out["peak_gib"] = None if peak is None else peak / GIB
        fpt = flops_per_token(self.cfg.model, self.seq)
        out["mfu"] = tps * fpt / (a.peak * 1e12) if a.peak else None
        del model, opt, loss_fn
        release(dev)
        return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available, else skip")
    ap.add_argument("--config", default=str(ROOT / "configs" / "spes-1b.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (vocab 512, d_model 64, 2 layers)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 4; --tiny 2)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 2048; --tiny 32)")
    ap.add_argument("--micro-batch", type=int, help="batch of the mb rows (default: the config's)")
    ap.add_argument("--local", type=int, default=4, help="experts the subset peer trains (default 4)")
    ap.add_argument("--warmup", type=int, help="untimed steps per row (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, help="timed steps per row (default 10; --tiny 2)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, help="default: on for CUDA")
    ap.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s for MFU (default: by GPU name)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows (default: all of {ROWS})")
    ap.add_argument("--no-round", action="store_true", help="skip the 2-peer round (gpu_round.py)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    return ap.parse_args(argv)


def emit(rec: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rec), flush=True)
        return
    if rec["kind"] == "row":
        if "error" in rec:
            print(f"{rec['row']:<20} {rec['batch']}x{rec['seq']}  ERROR {rec['error']}", flush=True)
            return
        mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.3g}%"
        peak = "n/a" if rec["peak_gib"] is None else f"{rec['peak_gib']:.2f} GiB"
        note = " (eager: compile failed: " + rec["compile_error"] + ")" if "compile_error" in rec else ""
        print(
            f"{rec['row']:<20} {rec['batch']}x{rec['seq']}  {rec['tokens_per_s']:>10,.0f} tok/s  MFU {mfu:>6}  "
            f"peak {peak:>10}  state {rec['state_bytes'] / GIB:.2f} GiB  step {rec['median_step_s'] * 1e3:.1f} ms  "
            f"loss {rec['loss_first']:.3f}{note}",
            flush=True,
        )
    elif rec["kind"] == "ratio":
        verdict = {True: "met", False: "NOT met", None: "not measured"}[rec.get("met")]
        goal = "" if rec["goal"] is None else f"  goal <= {rec['goal']}: {verdict}"
        value = "n/a" if rec["value"] is None else f"{rec['value']:.3f}"
        print(f"{rec['name']:<44} {value}{goal}", flush=True)
    elif rec["kind"] == "config":
        print("\n".join(f"{k}: {v}" for k, v in rec.items() if k != "kind"), flush=True)
    else:
        print(json.dumps(rec), flush=True)


def ratios(rows: dict[str, dict], mb: int) -> list[dict]:
    """The ratios the issue asks for, from the rows that ran (None where a row is missing or failed)."""

    def get(row, key):
        r = rows.get(row)
        return None if r is None or "error" in r else r.get(key)

    def ratio(name, a, b, key, goal=None):
        x, y = get(a, key), get(b, key)
        value = x / y if x is not None and y else None
        rec = {"kind": "ratio", "name": name, "value": value, "goal": goal}
        return rec | ({"met": None if value is None else value <= goal} if goal is not None else {})

    out = [
        ratio("peak memory 4of16 / all (same batch)", "ours-4of16", "ours-all", "peak_bytes", RATIO_GOAL),
        ratio("state bytes 4of16 / all", "ours-4of16", "ours-all", "state_bytes"),
        ratio("tokens/s ours-all / hf-olmoe", "ours-all", "hf-olmoe", "tokens_per_s"),
        ratio("tokens/s ours-4of16 / hf-olmoe", "ours-4of16", "hf-olmoe", "tokens_per_s"),
        ratio("peak memory ours-all / hf-olmoe", "ours-all", "hf-olmoe", "peak_bytes"),
        ratio("peak memory ours-4of16 / hf-olmoe", "ours-4of16", "hf-olmoe", "peak_bytes"),
    ]
    for row in ("ours-4of16-mb-ac", "ours-4of16-mb"):
        gib = get(row, "peak_gib")
        met = None if gib is None else gib <= MEM_GOAL_GIB
        out.append(
            {
                "kind": "ratio",
                "name": f"peak GiB {row} (batch {mb})",
                "value": gib,
                "goal": MEM_GOAL_GIB,
                "met": met,
            }
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("gpu_step: skipped: no CUDA device (use --device cpu --tiny to run it on CPU)")
            return 0
        args.device = "cuda"
    device = torch.device(args.device)
    cfg = load_config(args.config, (TINY if args.tiny else []) + list(args.set))
    batch, seq = args.batch or (2 if args.tiny else 4), args.seq or (32 if args.tiny else 2048)
    mb = args.micro_batch or (batch if args.tiny else cfg.data.micro_batch)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.steps = args.steps or (2 if args.tiny else 10)
    compile_ = args.compile if args.compile is not None else device.type == "cuda"
    args.peak, peak_src = device_peak_tflops(device, args.peak_tflops)
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := set(wanted) - set(ROWS):
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    if seq > cfg.model.max_seq_len:
        raise SystemExit(f"--seq {seq} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    m = cfg.model
    emit(
        {
            "kind": "config",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "shape": f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, "
            f"{m.n_experts} experts x hidden {m.expert_hidden}, top-{m.top_k}",
            "flops_per_token": flops_per_token(m, seq),
            "flops_formula": FLOPS_FORMULA,
            "peak_tflops": args.peak,
            "peak_source": peak_src,
            "compile": compile_,
            "timing": f"median of {args.steps} steps after {args.warmup} warm-up steps",
            "torch": torch.__version__,
        },
        args.json,
    )
    torch.manual_seed(0)
    init = MoETransformer(m)  # canonical weights once, on CPU; every row loads them
    init.init_weights(0)
    canonical = init.canonical_state_dict()
    del init
    local = list(range(args.local))
    specs = {
        "ours-all": dict(batch=batch),
        "ours-4of16": dict(batch=batch, local=local),
        "hf-olmoe": dict(batch=batch),
        "ours-4of16-mb-ac": dict(batch=mb, local=local, ac=True),
        "ours-4of16-mb": dict(batch=mb, local=local, ac=False),
    }
    rows = {}
    for name in wanted:
        spec = specs[name]
        row = Row(name, cfg, canonical, device, spec.pop("batch"), seq, args, **spec)
        rows[name] = row.run(compile_)
        emit(rows[name], args.json)
    for rec in ratios(rows, mb):
        emit(rec, args.json)
    if not args.no_round:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_round.py"), "--device", args.device]
        cmd += (
            ["--config", args.config] + [f"--set={s}" for s in args.set] + (["--tiny"] if args.tiny else [])
        )
        cmd += ["--json"] if args.json else []
        proc = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), timeout=900, check=False)
        if proc.returncode != 0:
            emit({"kind": "round", "error": f"gpu_round.py exited {proc.returncode}"}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
