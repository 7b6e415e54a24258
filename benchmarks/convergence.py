"""Is a model trained by the swarm as good as one trained centrally on the same tokens?

    python benchmarks/convergence.py                       # docs-corpus, demo shape, every row (~25 min)
    python benchmarks/convergence.py --quick               # 60 steps; central, swarm, no_merge, diloco_tokens
    python benchmarks/convergence.py --corpus stdlib --rows central swarm nesterov --json
    python benchmarks/convergence.py --set model.d_model=256 --steps 400 --out runs/conv
    python benchmarks/convergence.py --rows swarm diloco_tokens --row-set diloco_tokens:sync.sync_every_s=40 \
        --repeat 6 --json                                  # equal bytes, six runs each, alternating

Prepares the corpus with the project's own tools (``--corpus``: ../shared/data/docs-corpus.txt.xz by
default, ``stdlib`` for the embedded one, or a glob of .txt/.jsonl/.parquet files), then trains every row
for ``--steps`` steps per peer (``--peers`` peers; the centralized reference takes their combined batch
for as many steps) and judges each by one evaluator on exported HF models (``convergence_runs``):

    central        transformers' OlmoeForCausalLM, the peers' combined batch (the reference)
    swarm          the swarm as shipped (the config's sync section)
    no_merge       merge warm-up off
    replication2   every expert held by two peers (experts.per_peer doubled)
    nesterov       DiLoCo's outer step: sync_alpha 0.7, Nesterov momentum 0.9
    sync_half      rounds twice as often
    sync_double    rounds half as often
    diloco_tokens  every peer trains every expert (full-model DiLoCo), same tokens
    diloco_bytes   the same, rounds spaced so that it moves as many bytes per peer as the swarm
    every_step     (only when asked for) the ceiling of parameter averaging: the peers' batches and AdamW in
                   one process, every expert trained by every peer, weights averaged after every step
                   (``--average-every N``: every N steps, still synchronously, as a swarm that waited;
                   ``--average-codec int8``: through that codec, with error feedback, as ``sync.codec``;
                   ``--average-outer 0.7,0.9``: through the swarm's outer optimizer, as ``sync.sync_alpha``
                   and ``sync.outer_momentum``; ``--average-merge``: with the merge warm-up, as
                   ``sync.merge_*`` sets it; ``--average-experts-every M``: the experts every M steps and
                   the dense weights every N, as ``sync.refresh_every`` spaces a swarm's refresh rounds;
                   ``--average-delay D``: each average lands D steps late, as a round in the background;
                   ``--average-pooled-moment``: the replicas step as ``train.pooled_moment`` makes peers)
    every_step_spes  (only when asked for) the same with each peer training only its own
                   ``experts.per_peer`` experts, as swarm peers do: what partitioning the experts costs

On 2 cores (four peers of the demo shape share them) a row of 140 steps (the default) took 2 to 3 minutes
(central 117 s, swarm rows 124 to 180 s on the docs corpus, 2026-11-26): every row in about 25 minutes. Runs
of 250 steps took about 7 minutes a row in an earlier series.

The in-process rows (central, every_step, every_step_spes) run on ``--device`` (``cuda`` for long
horizons); the swarm rows run as the config says.

Printed: final validation loss, its ratio to central, bytes per peer (what each peer's p2pd carried, both
directions, overhead and copies served to others included; with ``--transport local`` the rounds' payload
by arithmetic), wall time. ``--out`` gets ``convergence.json`` (every number and curve) and ``convergence.png``
(validation loss against tokens; the swarm rows' curves are peer 0's own ``val_loss``, the central one the
evaluator's). ``--json`` prints one JSON object per row.

Swarm runs of one row differ by 0.5 to 1.5% (time-based rounds on busy cores), about as much as the rows
differ: ``--repeat N`` runs the swarm rows N times, interleaved so that a slow spell of the machine hits
every row alike (the in-process rows are deterministic and run once), and ends with one summary per row:
mean, standard deviation, range, mean bytes, and against the swarm row its difference and Welch's t.
``--row-set ROW:KEY=VALUE`` overrides one row's config only (a full-model DiLoCo whose rounds are as far
apart as makes its bytes the swarm's, say).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from swarm.sync.codecs import CODECS  # noqa: E402

ROWS = ("central", "swarm", "no_merge", "replication2", "nesterov", "sync_half", "sync_double",
        "diloco_tokens", "diloco_bytes")  # fmt: skip
EXTRA_ROWS = ("every_step", "every_step_spes")
QUICK_ROWS = ("central", "swarm", "no_merge", "diloco_tokens")
IN_PROCESS_ROWS = ("central", *EXTRA_ROWS)
SWARM_ROWS = tuple(r for r in ROWS if r not in IN_PROCESS_ROWS)
DOCS_CORPUS = ROOT.parent / "shared" / "data" / "docs-corpus.txt.xz"


def row_overrides(name: str, cfg, diloco_scale: float = 2.0) -> list[str]:
    """The config overrides that make a swarm row (on top of ``--set``). Intervals scale whichever way the
    config times its rounds: ``sync_every`` steps, or ``sync_every_s`` seconds of wall clock."""
    per_peer = cfg.experts.per_peer or cfg.model.n_experts
    by_time = cfg.sync.sync_every_s > 0

    def every(scale: float) -> str:
        if by_time:
            return f"sync.sync_every_s={max(1.0, cfg.sync.sync_every_s * scale):g}"
        return f"sync.sync_every={max(1, round(cfg.sync.sync_every * scale))}"

    return {
        "swarm": [],
        "no_merge": ["sync.merge_warmup_steps=0"],
        "replication2": [f"experts.per_peer={min(cfg.model.n_experts, 2 * per_peer)}"],
        "nesterov": ["sync.sync_alpha=0.7", "sync.outer_momentum=0.9"],
        "sync_half": [every(0.5)],
        "sync_double": [every(2.0)],
        "diloco_tokens": [f"experts.per_peer={cfg.model.n_experts}"],
        "diloco_bytes": [f"experts.per_peer={cfg.model.n_experts}", every(diloco_scale)],
    }[name]


def add_run_args(ap: argparse.ArgumentParser, each: str) -> None:
    """The options of every in-process comparison (this script's, ``update_averaging.py``'s): the config
    and its overrides (for every ``each``: row, mode), the corpus, steps per peer, peers."""
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=f"for every {each}")
    ap.add_argument("--corpus", default=str(DOCS_CORPUS), help='a .xz/.txt file, a glob, or "stdlib"')
    ap.add_argument("--corpus-mb", type=float, default=12.0, help="how much of a .xz/.txt corpus")
    ap.add_argument("--steps", type=int, default=140, help="optimizer steps per peer")
    ap.add_argument("--peers", type=int, default=4)


def run_config(args: argparse.Namespace, steps: int, work: Path):
    """The corpus prepared under ``work`` and the config every run trains with (its schedule over
    ``steps``), with the overrides that made it."""
    from convergence_runs import prepare_corpus

    from swarm.config import load_config

    data = prepare_corpus(args.corpus, work / "corpus", mb=args.corpus_mb)
    sets = [*args.set, f"data.path={data}", f"train.max_steps={steps}", f"train.decay_steps={steps}"]
    return load_config(args.config, sets), sets


def main(argv: list[str] | None = None) -> int:
    from convergence_runs import run_central, run_swarm
    from every_step_runs import run_every_step, unmodelled

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, "row")
    ap.add_argument("--rows", nargs="+", default=None, choices=ROWS + EXTRA_ROWS, help="default: every row")
    ap.add_argument("--transport", choices=("process", "local"), default="process")
    ap.add_argument("--average-every", type=int, default=1, help="the every_step rows' interval (steps)")
    ap.add_argument("--average-experts-every", type=int, default=0, metavar="N",
                    help="the every_step rows average the experts (refresh copies) every N steps, the "
                         "dense weights every --average-every (default: both every --average-every)")  # fmt: skip
    ap.add_argument("--average-embeddings-every", type=int, default=0, metavar="N",
                    help="the every_step rows average the token embeddings and output head every N steps, "
                         "the rest of the dense weights every --average-every (default: with them)")  # fmt: skip
    ap.add_argument("--average-early", type=_every_until, default=(0, 0), metavar="EVERY,UNTIL",
                    help="the every_step rows average the dense weights every EVERY steps up to step UNTIL, "
                         "then every --average-every (default: every --average-every throughout)")  # fmt: skip
    ap.add_argument("--average-delay", type=int, default=0, metavar="N",
                    help="the every_step rows' averages land N steps after their snapshots, the steps "
                         "taken meanwhile kept, as rounds in the background do (default 0)")  # fmt: skip
    ap.add_argument("--average-codec", default="fp32", choices=tuple(CODECS),
                    help="how the every_step rows' averages travel (coded_average)")  # fmt: skip
    ap.add_argument("--average-dense-codec", default="", choices=("", *CODECS),
                    help="the dense weights' codec there (default: --average-codec)")  # fmt: skip
    ap.add_argument("--average-outer", type=_alpha_momentum, default=(1.0, 0.0), metavar="ALPHA,MOMENTUM",
                    help="the every_step rows' outer step (outer_average; default 1,0: plain)")  # fmt: skip
    ap.add_argument("--average-merge", action="store_true",
                    help="the every_step rows merge as the swarm's warm-up does (sync.merge_*)")  # fmt: skip
    ap.add_argument("--average-pooled-moment", action="store_true",
                    help="the every_step rows' replicas step with PooledMomentAdamW: each one's second "
                         "moment the pooled batch's, estimated from its batch's two halves")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="for the in-process rows: cpu or cuda")
    ap.add_argument("--quick", action="store_true", help=f"60 steps per peer; rows {', '.join(QUICK_ROWS)}")
    ap.add_argument("--out", default=None, help="directory for convergence.json and convergence.png")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the runs' directories here (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=1, help="run the swarm rows this many times, interleaved")
    ap.add_argument("--row-set", action="append", default=[], metavar="ROW:KEY=VALUE",
                    help="a config override for one swarm row only")  # fmt: skip
    args = ap.parse_args(argv)
    # SIGTERM as Ctrl+C: the swarm rows' ``finally`` then stops their peers and bootstrap (each in a session
    # of its own), which the default action would leave running
    signal.signal(signal.SIGTERM, _interrupt)
    steps = 60 if args.quick else args.steps
    if args.rows is None:
        args.rows = list(QUICK_ROWS if args.quick else ROWS)
    if args.repeat < 1 or steps < 1 or args.peers < 1:
        ap.error("--repeat, --steps and --peers must be at least 1")
    if args.average_every < 1 or min(args.average_experts_every, args.average_delay,
                                     args.average_embeddings_every) < 0:  # fmt: skip
        ap.error("--average-every must be at least 1, --average-experts-every, --average-embeddings-every "
                 "and --average-delay >= 0")  # fmt: skip
    lossless = args.average_codec == "fp32" and args.average_dense_codec in ("", "fp32")
    split = args.average_experts_every not in (0, args.average_every)
    outer = args.average_outer != (1.0, 0.0)
    embeddings = args.average_embeddings_every not in (0, args.average_every)
    early = args.average_early[0] != 0
    if why := unmodelled(split, args.average_delay, outer, args.average_merge, lossless, embeddings, early):
        ap.error(why)
    try:
        row_sets = parse_row_sets(args.row_set)
    except ValueError as e:
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="swarm-convergence-") as tmp:
        work = Path(args.keep or tmp)
        cfg, sets = run_config(args, steps, work)
        rows = list(args.rows)
        if "diloco_bytes" in rows:  # needs both measured first
            rows = [r for r in ROWS + EXTRA_ROWS if r in rows or r in ("swarm", "diloco_tokens")]
        runs, diloco_scale = {}, 2.0  # every run of each row, in order
        for rep in range(args.repeat):
            for name in rows:
                if name in IN_PROCESS_ROWS and rep > 0:
                    continue  # deterministic: central gave 6.069210 again bit for bit, run after run
                if name == "central":
                    res = run_central(cfg, steps, args.peers, max(1, steps // 8), device=args.device)
                elif name in EXTRA_ROWS:
                    res = run_every_step(cfg, steps, args.peers, max(1, steps // 8), args.average_every,
                                         own_experts=name == "every_step_spes", device=args.device,
                                         codec=args.average_codec,
                                         dense_codec=args.average_dense_codec,
                                         outer=args.average_outer, merge=args.average_merge,
                                         experts_every=args.average_experts_every,
                                         delay=args.average_delay,
                                         pooled_moment=args.average_pooled_moment,
                                         embeddings_every=args.average_embeddings_every,
                                         early=args.average_early)  # fmt: skip
                else:
                    if name == "diloco_bytes":
                        diloco_scale = _scale_for_equal_bytes({k: v[-1] for k, v in runs.items()})
                    extra = [*sets, *row_overrides(name, cfg, diloco_scale), *row_sets.get(name, [])]
                    where = work / (name if rep == 0 else f"{name}-{rep + 1}")
                    res = run_swarm(name, Path(args.config), extra, steps, args.peers, where, args.transport)
                runs.setdefault(name, []).append(res)
                central = runs.get("central", [None])[0]
                _print_row(res, central, args.json, row_sets.get(name, []), rep)
        summaries = summarize(runs) if args.repeat > 1 else []
        for summary in summaries:
            _print_summary(summary, args.json)
        if args.out:
            _save(runs, summaries, Path(args.out), args, steps)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _alpha_momentum(text: str) -> tuple[float, float]:
    """``ALPHA,MOMENTUM`` as ``sync.sync_alpha`` and ``sync.outer_momentum`` accept them (their own checks)."""
    from swarm.config import SyncConfig

    try:
        alpha, momentum = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ALPHA,MOMENTUM, like 1,0.5") from None
    try:
        SyncConfig(sync_alpha=alpha, outer_momentum=momentum)
    except ValueError as e:  # ConfigError: one line naming the key
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return alpha, momentum


def _every_until(text: str) -> tuple[int, int]:
    """``EVERY,UNTIL``: two whole numbers of steps, each at least 1."""
    try:
        every, until = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected EVERY,UNTIL, like 2,80") from None
    if every < 1 or until < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: EVERY and UNTIL must be at least 1")
    return every, until


def parse_row_sets(items: list[str]) -> dict[str, list[str]]:
    """``ROW:KEY=VALUE`` items as each swarm row's own overrides (applied after the row's own)."""
    out: dict[str, list[str]] = {}
    for item in items:
        row, _, setting = item.partition(":")
        if row not in SWARM_ROWS:
            raise ValueError(f"--row-set {item!r}: {row!r} is not a swarm row ({', '.join(SWARM_ROWS)})")
        if "=" not in setting:
            raise ValueError(f"--row-set {item!r}: expected ROW:KEY=VALUE")
        out.setdefault(row, []).append(setting)
    return out


def summarize(runs: dict[str, list], base: str = "swarm") -> list[dict]:
    """Per row with two runs or more: mean, sample standard deviation, range and mean bytes of its runs,
    and against ``base``'s runs (when there are two or more) the difference of the means (% of base's;
    negative: lower loss than base) and Welch's t (positive: higher loss than base)."""
    ref = [r.val_loss for r in runs.get(base, [])]
    out = []
    for name, rs in runs.items():
        losses = [r.val_loss for r in rs]
        if len(losses) < 2:
            continue
        s = {"summary": name, "runs": len(losses), "val_loss_mean": statistics.fmean(losses),
             "val_loss_sd": statistics.stdev(losses), "val_loss_min": min(losses), "val_loss_max": max(losses),
             "bytes_per_peer_mean": statistics.fmean(r.bytes_per_peer for r in rs)}  # fmt: skip
        if name != base and len(ref) >= 2:
            s[f"vs_{base}_pct"] = 100 * (s["val_loss_mean"] / statistics.fmean(ref) - 1)
            s["welch_t"] = welch_t(losses, ref)
        out.append(s)
    return out


def welch_t(a: list[float], b: list[float]) -> float:
    """Welch's t of mean(a) - mean(b) (unequal variances); inf or nan when both samples are constant."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    diff = statistics.fmean(a) - statistics.fmean(b)
    return diff / se if se > 0 else (math.copysign(math.inf, diff) if diff else math.nan)


def _scale_for_equal_bytes(results: dict) -> float:
    """How much farther apart full-model DiLoCo's rounds must be to move as many bytes per peer as the swarm:
    its bytes per round (measured by ``diloco_tokens``) against the swarm's bytes in all."""
    swarm, full = results["swarm"], results["diloco_tokens"]
    if not full.rounds_started or not swarm.bytes_per_peer:
        return 2.0
    rounds = max(1.0, swarm.bytes_per_peer / (full.bytes_per_peer / full.rounds_started))
    return max(1.0, full.rounds_started / rounds)


def _print_row(res, central, as_json: bool, row_set: list[str], rep: int) -> None:
    ratio = res.val_loss / central.val_loss if central else None  # without the central row: null, not NaN
    if as_json:
        print(json.dumps({"row": res.name, "val_loss": res.val_loss, "ratio_to_central": ratio,
                          "bytes_per_peer": res.bytes_per_peer, "wall_s": res.wall_s, "tokens": res.tokens,
                          "rounds_applied": res.rounds_applied, "row_set": row_set,
                          "repeat": rep}), flush=True)  # fmt: skip
        return
    of_central = f"x{ratio:.3f} of central" if ratio is not None else "(no central row)"
    print(f"{res.name:>14}: val loss {res.val_loss:.4f}  {of_central}  "
          f"{res.bytes_per_peer / 1e6:8.1f} MB/peer  {res.wall_s:6.0f} s  {res.tokens:,} tokens  "
          f"{res.rounds_applied} dense rounds applied  {' '.join(row_set)}", flush=True)  # fmt: skip


def _print_summary(s: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(s), flush=True)
        return
    against = next((k for k in s if k.startswith("vs_")), None)
    vs = f"  {s[against]:+.2f}% against {against[3:-4]} (Welch's t {s['welch_t']:+.2f})" if against else ""
    print(f"{s['summary']:>14}: {s['runs']} runs, val loss {s['val_loss_mean']:.4f} +- {s['val_loss_sd']:.4f} "
          f"({s['val_loss_min']:.4f} to {s['val_loss_max']:.4f})  {s['bytes_per_peer_mean'] / 1e6:.1f} MB/peer"
          f"{vs}", flush=True)  # fmt: skip


def _save(runs: dict, summaries: list[dict], out: Path, args, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    results = {k: v[0] for k, v in runs.items()}  # the first run of each row is the one plotted
    payload = {"args": vars(args), "steps": steps, "rows": {k: asdict(v) for k, v in results.items()}}
    if args.repeat > 1:
        payload["runs"] = {k: [asdict(r) for r in v] for k, v in runs.items()}
        payload["summary"] = summaries
    (out / "convergence.json").write_text(json.dumps(payload, indent=1))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, res in results.items():
        if res.curve:
            xs, ys = zip(*res.curve, strict=True)
            ax.plot(
                xs, ys, label=f"{name} ({res.val_loss:.3f})", lw=2.5 if name in ("central", "swarm") else 1.2
            )
    ax.set_xlabel("tokens (all peers)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{Path(args.corpus).name}: {args.peers} peers x {steps} steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=110)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: the runs' processes are stopped by now
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
