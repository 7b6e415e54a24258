"""Where the floor of parameter averaging comes from: four peers that average their weights after every
AdamW step against the same peers averaging their gradients before one shared step.

    python benchmarks/update_averaging.py                        # docs corpus, 140 steps, every mode (~9 min)
    python benchmarks/update_averaging.py --steps 560 --json     # 4.6M tokens
    python benchmarks/update_averaging.py --corpus stdlib --modes central gradients weights
    python benchmarks/update_averaging.py --steps 560 --modes central hf_pooled --draw 2   # another draw
    python benchmarks/update_averaging.py --steps 560 --draw 0 1 2 --json   # three draws, then a summary
    python benchmarks/update_averaging.py --summarize d1.jsonl d2.jsonl     # the summary of earlier --json runs

Every mode but central trains our model on the same windows (each peer's, as ``convergence.py``'s
every_step row draws them), in this process, from the same initial weights; all are judged by the one
evaluator of ``convergence_runs`` and compared with the centralized reference at equal tokens:

    central     transformers' OlmoeForCausalLM on the peers' combined batch (``run_central``)
    gradients   the peers' gradients averaged before one AdamW step: data-parallel training, which moves the
                whole model's gradients every step
    hf_pooled   central on the pooled windows of the peers (below) instead of its own: HF's model on the
                very windows of ``pooled``, so the two differ by the model alone
    pooled      the peers' windows in one forward pass and one AdamW step: the gradients mode but for the
                load-balancing loss, which it pools over the combined batch (as central's is) instead of
                averaging the peers' own; the same windows, so the two differ by that alone
    weights     each peer its own AdamW step on its own batch, the weights averaged after each: the every_step
                row, the fastest any swarm of weight averages can round
    moments     the same, with AdamW's two moments averaged too (twice the weights' bytes more per round)

``hf_pooled`` against ``central`` is what the peers' windows cost (a draw of the data), ``pooled`` against
``hf_pooled`` what our model costs, ``gradients`` against ``pooled`` what the load-balancing loss of each
peer's batch costs, and ``weights`` against ``gradients`` what averaging the results of separate AdamW steps
costs, however often it is done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("central", "hf_pooled", "pooled", "gradients", "weights", "moments", "pooled_moment")


class PooledWindows:
    """The peers' windows of a step (``peer_samplers``) as one batch: ``next_batch()`` as a sampler's."""

    def __init__(self, samplers: list):
        self.samplers = samplers

    def next_batch(self) -> torch.Tensor:
        return torch.cat([s.next_batch() for s in self.samplers])


def run_data_parallel(
    cfg, steps: int, peers: int, eval_every: int, device: str = "cpu", pooled: bool = False, draw: int = 0
):
    """One replica of our model; each step the mean of the ``peers`` peers' losses (each on its own
    ``micro_batch`` windows, drawn as the every_step row's peers draw them) is backpropagated, so that the
    gradient is the peers' mean gradient, clipped and applied by one AdamW step, as data-parallel training
    does. ``pooled``: the peers' windows concatenated into one batch and one loss instead; the LM and z-loss
    terms are means over tokens either way, so only the load-balancing term (a product of two batch means)
    differs."""
    from convergence_runs import RunResult, heldout_loss, hf_model_from

    from benchmarks.replica_rounds import peer_samplers
    from swarm.data.run_dataset import open_dataset
    from swarm.model import MoETransformer
    from swarm.train.optimizer import build_optimizer, set_lr
    from swarm.train.schedule import lr_at

    t0, t, ds = time.monotonic(), cfg.train, open_dataset(cfg, progress=False)
    model = MoETransformer(cfg.model, list(range(cfg.model.n_experts)), cfg.experts.frozen_dtype)
    model.init_weights(t.seed)
    model.to(device)
    opt = build_optimizer(model, t)
    samplers = peer_samplers(ds, cfg, peers, draw)
    samplers = [PooledWindows(samplers)] if pooled else samplers

    def evaluate() -> float:
        return heldout_loss(hf_model_from(cfg, model.canonical_state_dict()).to(device), cfg, device=device)

    tokens, curve = 0, [(0, evaluate())]
    for step in range(steps):
        set_lr(opt, lr_at(step, t))
        for sampler in samplers:
            batch = sampler.next_batch().to(device)
            (model(batch[:, :-1], targets=batch[:, 1:]).loss / len(samplers)).backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.trainable_parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += peers * cfg.data.micro_batch * cfg.data.seq_len
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((tokens, evaluate()))
    return RunResult(
        "pooled" if pooled else "gradients", curve[-1][1], tokens, time.monotonic() - t0, curve=curve
    )


def run_mode(mode: str, cfg, steps: int, peers: int, device: str = "cpu", draw: int = 0):
    """One mode's run (``MODES``), its curve evaluated at eight points, on the ``draw``-th draw of the
    windows (central's own and the peers'; 0 the draw of every result before the option existed)."""
    from convergence_runs import run_central
    from every_step_runs import run_every_step

    every = max(1, steps // 8)
    if mode == "central":
        return run_central(cfg, steps, peers, every, device=device, draw=draw)
    if mode == "hf_pooled":
        from benchmarks.replica_rounds import peer_samplers
        from swarm.data.run_dataset import open_dataset

        windows = PooledWindows(peer_samplers(open_dataset(cfg, progress=False), cfg, peers, draw))
        res = run_central(cfg, steps, peers, every, device=device, sampler=windows)
        res.name = mode
        return res
    if mode in ("gradients", "pooled"):
        return run_data_parallel(cfg, steps, peers, every, device=device, pooled=mode == "pooled", draw=draw)
    res = run_every_step(
        cfg,
        steps,
        peers,
        every,
        device=device,
        moments=mode == "moments",
        draw=draw,
        pooled_moment=mode == "pooled_moment",
    )
    res.name = mode
    return res


def summarize_draws(records: list[dict]) -> list[dict]:
    """Per mode run on two draws or more (``records``: the ``--json`` lines of any runs, one per mode and
    draw): mean, sample standard deviation and range of its validation loss, and against every other mode
    run on the same draws the per-draw ratio (its loss over the other's on the same windows), mean and
    standard deviation. A draw run twice for one mode is an error: the summary would count it twice."""
    by_mode: dict[str, dict[int, float]] = {}
    for r in records:
        runs = by_mode.setdefault(r["mode"], {})
        if r["draw"] in runs:
            raise ValueError(f"mode {r['mode']!r} has draw {r['draw']} twice")
        runs[r["draw"]] = float(r["val_loss"])
    out = []
    for mode, runs in by_mode.items():
        if len(runs) < 2:
            continue
        losses = list(runs.values())
        s = {"summary": mode, "draws": sorted(runs), "val_loss_mean": statistics.fmean(losses),
             "val_loss_sd": statistics.stdev(losses), "val_loss_min": min(losses), "val_loss_max": max(losses)}  # fmt: skip
        for other, theirs in by_mode.items():
            shared = sorted(set(runs) & set(theirs))
            if other != mode and len(shared) >= 2:
                ratios = [runs[d] / theirs[d] for d in shared]
                s[f"vs_{other}"] = {"draws": shared, "ratio_mean": statistics.fmean(ratios),
                                    "ratio_sd": statistics.stdev(ratios)}  # fmt: skip
        out.append(s)
    return out


def read_records(paths: list[str]) -> list[dict]:
    """The per-mode lines of earlier ``--json`` runs (summary lines and anything else skipped)."""
    records = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc})") from None
            if "mode" in r:
                if not isinstance(r.get("draw"), int) or not isinstance(r.get("val_loss"), (int, float)):
                    raise ValueError(f"{path}:{n}: a mode's line needs an integer draw and a val_loss")
                records.append(r)
    return records


def print_summary(summaries: list[dict], as_json: bool) -> None:
    for s in summaries:
        if as_json:
            print(json.dumps(s), flush=True)
            continue
        vs = "  ".join(f"/{k[3:]} {v['ratio_mean']:.4f} +- {v['ratio_sd']:.4f}" for k, v in s.items()
                       if k.startswith("vs_"))  # fmt: skip
        print(f"{s['summary']:>10}: {len(s['draws'])} draws, val loss {s['val_loss_mean']:.4f} +- "
              f"{s['val_loss_sd']:.4f} ({s['val_loss_min']:.4f}..{s['val_loss_max']:.4f})  {vs}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from convergence import add_run_args, run_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, "mode")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--draw", type=int, nargs="+", default=[0], metavar="N",
                    help="which draws of the training windows, central's and the peers' (default 0); the "
                         "initial weights follow train.seed alone; with two or more, a summary at the end")  # fmt: skip
    ap.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSONL",
        help="train nothing: the summary over the draws in these files of earlier --json runs",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per mode and draw, then per summary")
    args = ap.parse_args(argv)
    if args.summarize:
        try:
            print_summary(summarize_draws(read_records(args.summarize)), args.json)
        except (OSError, ValueError, KeyError) as exc:
            ap.error(str(exc))
        return 0
    if args.steps < 1 or args.peers < 1 or min(args.draw) < 0 or len(set(args.draw)) < len(args.draw):
        ap.error("--steps and --peers must be at least 1, each --draw at least 0 and given once")
    records = []
    with tempfile.TemporaryDirectory(prefix="swarm-update-averaging-") as tmp:
        cfg, _ = run_config(args, args.steps, Path(tmp))
        for draw in args.draw:
            central = None
            for mode in args.modes:
                res = run_mode(mode, cfg, args.steps, args.peers, args.device, draw)
                central = res if mode == "central" else central
                ratio = res.val_loss / central.val_loss if central else None
                records.append({"mode": mode, "draw": draw, "val_loss": res.val_loss, "ratio_to_central": ratio,
                                "tokens": res.tokens, "wall_s": res.wall_s, "curve": res.curve})  # fmt: skip
                if args.json:
                    print(json.dumps(records[-1]), flush=True)
                else:
                    of = f"x{ratio:.4f} of central" if ratio is not None else "(no central mode)"
                    print(f"{mode:>10}: draw {draw}  val loss {res.val_loss:.4f}  {of}  {res.tokens:,} tokens  "
                          f"{res.wall_s:5.0f} s", flush=True)  # fmt: skip
    print_summary(summarize_draws(records), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
