"""A real swarm over bandwidth-limited links, once per codec: what a round costs and what it buys.

    sudo python benchmarks/wan.py --quick            # demo shape, 4 rounds per codec, ~10 min on 2 cores
    sudo python benchmarks/wan.py --mbit 100 --json  # demo and wide shapes, one JSON object per line
    sudo python benchmarks/wan.py --quick --rtt-ms 50  # with 50 ms between any two peers, there and back

A bootstrap peer and N peers (default 4) each run in a network namespace of their own, on links shaped to
``--mbit`` in each direction (``netns_links``: tbf). Without ``--rtt-ms`` no latency is added (this kernel
has no netem); with it, a user-space delay line (``delay_line``) holds every frame so that any two peers are
that many milliseconds apart there and back (links of 9000-byte frames; ``--rtt-ms 0``: the same links
without the delay, the baseline to compare with). Every peer trains ``--rounds`` sync intervals with the
codec under test and stops; then, per codec and shape:

- ``bytes_per_round``: what a peer moved per round (sent + received, at its p2pd), everything from the end
  of its first ordinary round to the end of its last divided by the rounds between (so downloads it served
  to others outside its own rounds, heartbeats and digests count too), mean over peers;
  ``round_bytes`` only what moved during its own rounds (``wire_bytes``); ``link_bytes_per_round`` the
  whole run read at its link (IP headers, joining and the last round included) divided by its rounds;
- ``bytes_ratio``: that divided by a fp32 full-model all-reduce among the same peers, 2 x 2(n-1)/n x the
  model's fp32 bytes (a butterfly sends and receives 2(n-1)/n of it);
- ``round_vs_link``: a round's wall time divided by its payload's time on the link (half of what moved
  during the round, ``round_bytes``: each direction carries about half, at ``--mbit``), median over rounds;
  ``round_vs_link_later`` the same without each peer's first round (its groups' first meeting over the
  links: about 1.8x on H100 peers at 58f2243, where later rounds took 1.25x);
  ``phase_s``: where a round's time went (median seconds per phase, ``RoundRecord.phase_seconds``),
  ``startup_s`` how long its own start-up took (``RoundRecord.startup_s``: on hivemind, within
  matchmaking) and ``startup_parts_s`` where it went (``RoundRecord.startup_seconds``), and
  ``check_s`` where its checks' went (``RoundRecord.check_seconds``), ``downloads_s`` when a refresh
  round's downloads began and ended and how long the longest waited for a holder's fresh copy;
  ``round_fit``: a round's seconds as ``fixed_s`` + ``per_payload`` x its payload's seconds on the link
  (least squares over the rounds): what a round costs whatever it carries, and how close to the link's
  rate it carries the rest; ``link_use``: how busy the peer's link was during its rounds
  (``benchmarks/link_use.py``, medians): ``busy`` the share of the round that its busier direction's bytes
  need at ``--mbit``, ``head_s`` the seconds before that direction first ran at half the link's rate or
  more, ``tail_s`` those after it last did;
  each peer's link timeline (wall time, bytes sent, bytes received, every 50 ms) is kept in its run
  directory as ``link.jsonl``;
- ``skipped_share``: sync points at which no round started, and ``skipped_reasons`` how many for each
  reason ("previous round still in flight", "too close to the last round" near the step limit, ...);
- ``val_loss``: the peers' validation loss after the run (mean);
- ``rtt_ms`` as asked, and ``delay_line_cpu_s``: the CPU seconds the delay line took over the run.

Stopped by SIGINT or SIGTERM while its peers train, a run is still measured from the rounds they took so
far (its row says ``"interrupted": true``, and has no ``val_loss``); the codecs and shapes after it are not run.

Shapes: ``demo`` (configs/demo.yaml) and ``wide`` (dense and experts scaled so that the model holds over
100 MB of fp32). ``--set`` passes overrides to every peer (e.g. ``data.path=...`` for another corpus).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.link_use import LinkSampler, link_use  # noqa: E402
from benchmarks.netns_links import ShapedLan, prepare_benchmark  # noqa: E402
from peers.demo import wait_for_maddr  # noqa: E402
from peers.demo_summary import read_jsonl  # noqa: E402
from swarm.config import RunConfig, load_config, save_config  # noqa: E402
from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets  # noqa: E402
from swarm.sync.codecs import CODECS as KNOWN_CODECS  # noqa: E402
from swarm.train.round_record import RoundRecord  # noqa: E402

# "a/b": sync.codec a (the experts), sync.dense_codec b; "a": a for both. The default first, then int8 for
# everything and the exact baseline (fp16 and int4 by name)
CODECS = ("int8/int4", "int8", "fp32")
SHAPES = {
    "demo": [],
    # about 135 MB of fp32: experts dominate, as in the real models
    "wide": ["model.d_model=256", "model.expert_hidden=512", "model.n_layers=4", "model.n_heads=4"],
}
STOP_S = 90  # after the last peer should have finished: a peer still running is stopped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="A swarm over shaped links, per codec (needs root).")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate in each direction (default 100)")
    ap.add_argument("--rtt-ms", type=float, default=None,
                    help="round-trip time between any two peers, added by a delay line (default: none)")  # fmt: skip
    ap.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                    help="a network sysctl set in every peer's namespace (e.g. net.ipv4.tcp_slow_start_after_idle=0)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=8, help="sync intervals each peer trains (default 8)")
    ap.add_argument("--codecs", default=",".join(CODECS),
                    help=f"comma-separated from {', '.join(KNOWN_CODECS)}; a/b: sync.codec a, sync.dense_codec b "
                    f"(default {','.join(CODECS)})")  # fmt: skip
    ap.add_argument("--shapes", default="demo,wide", help="comma-separated: demo, wide (default both)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every peer")
    ap.add_argument("--run-dir", default="runs/wan", help="logs and metrics of every run")
    ap.add_argument("--quick", action="store_true", help="demo shape, 4 rounds")
    ap.add_argument("--json", action="store_true", help="one JSON object per codec and shape per line")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.rounds = "demo", 4
    args.codecs, args.shapes = args.codecs.split(","), args.shapes.split(",")
    bad = [c for c in args.codecs if not set(c.split("/", 1)) <= set(KNOWN_CODECS)] + [
        s for s in args.shapes if s not in SHAPES
    ]
    bad += [kv for kv in args.sysctl if "=" not in kv or not kv.startswith("net.")]
    if bad or args.peers < 2 or args.rounds < 2 or not 0 <= (args.rtt_ms or 0) <= 10_000:
        ap.error(
            f"unknown codecs, shapes or sysctls (net.*=value) {bad}"
            if bad
            else "needs --peers >= 2, --rounds >= 2, --rtt-ms in [0, 10000]"
        )
    return args


def model_bytes(cfg: RunConfig) -> int:
    import torch

    from swarm.model import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    return 4 * sum(p.numel() for p in model.parameters())


class Processes:
    """Every process this benchmark starts, each in a session of its own: stopped by process group, and the
    p2p sockets left by any that had to be killed removed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.sockets_before = p2p_sockets()

    def start(self, argv: list[str], log: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.procs = []
        remove_stale_p2p_sockets(self.sockets_before)


def run_swarm(args, shape: str, codec: str, run: Path) -> dict:
    experts, _, dense = codec.partition("/")
    overrides = [*SHAPES[shape], f"sync.codec={experts}", f"sync.dense_codec={dense or experts}", *args.set]
    cfg = load_config(args.config, overrides)
    steps = args.rounds * cfg.sync.sync_every
    run.mkdir(parents=True, exist_ok=True)
    effective = run / "config.yaml"
    save_config(cfg, effective)
    py, procs = sys.executable, Processes()
    with (
        ShapedLan(
            args.peers + 1, args.mbit, args.rtt_ms, dict(kv.split("=", 1) for kv in args.sysctl)
        ) as lan,
        LinkSampler(lan.counters, range(1, args.peers + 1)) as links,
    ):
        try:
            boot = procs.start(lan.command(0, [py, "-m", "bootstrap.main", "--host", lan.address(0),
                                               "--config", str(effective)]), run / "bootstrap.log")  # fmt: skip
            maddr = wait_for_maddr(run / "bootstrap.log", boot)
            before = [lan.counters(i + 1) for i in range(args.peers)]
            t0 = time.monotonic()
            peers = []
            for i in range(args.peers):
                cmd = [py, "-m", "peers.main", "--config", str(effective), "--host", lan.address(i + 1),
                       "--initial-peers", maddr, "--run-dir", str(run / f"peer{i}"), "--max-steps", str(steps),
                       "--no-progress", "--set", f"train.threads={max(1, (os.cpu_count() or 1) // args.peers)}"]  # fmt: skip
                peers.append(procs.start(lan.command(i + 1, cmd), run / f"peer{i}.log"))
            bound = t0 + STOP_S + steps * 5.0  # far above any shape's step time here: only a hang reaches it
            interrupted = False
            try:
                while any(p.poll() is None for p in peers) and time.monotonic() < bound:
                    time.sleep(1)
            except KeyboardInterrupt:  # stopped early: the rounds the peers took so far are still measured
                interrupted = True
            wall = time.monotonic() - t0
            after = [lan.counters(i + 1) for i in range(args.peers)]
            codes = [p.poll() for p in peers]
            line_cpu = lan.delay_line_cpu_s()
        finally:
            procs.stop()
    row = measure(args, cfg, run, codes, before, after, wall, links)
    if line_cpu is not None:
        row["delay_line_cpu_s"] = round(line_cpu, 1)
    return row | {"interrupted": True} if interrupted else row


def payload_s(wire_bytes: int, mbit: float) -> float:
    """A round's payload's time on the link: half its ``wire_bytes`` (each direction carries about half)."""
    return wire_bytes / 2 * 8 / (mbit * 1e6)


def link_ratios(by_peer: list[list[tuple[float, int]]], mbit: float, skip_first: bool = False) -> list[float]:
    """Each round's seconds over its payload's time on the link, from each peer's ``(seconds, wire_bytes)``
    in order; ``skip_first`` leaves out each peer's first round."""
    return [s / payload_s(b, mbit) for rounds in by_peer for s, b in rounds[int(skip_first) :]]


def round_fit(points: list[tuple[float, float]]) -> dict | None:
    """Least squares of round seconds on payload seconds, over ``(payload_s, round_s)`` points:
    ``{"fixed_s", "per_payload"}``, or None with fewer than 3 rounds or payloads too alike to tell the two
    apart (the smallest more than half the largest: fp32 rounds all carry the same, and a fit through
    them extrapolates noise to a negative fixed part)."""
    sizes = [p for p, _ in points]
    if len(points) < 3 or min(sizes) > 0.5 * max(sizes):
        return None
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return {"fixed_s": round(intercept, 3), "per_payload": round(slope, 3)}


def measure(args, cfg: RunConfig, run: Path, codes, before, after, wall: float, links: LinkSampler) -> dict:
    n, per_round, in_round, link, skipped, started, losses = args.peers, [], [], [], 0, 0, []
    reasons: dict[str, int] = {}
    uses, startups, by_peer = [], [], []
    phases: dict[str, list[float]] = {}
    checks: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    fetches: dict[str, list[float]] = {}
    for i in range(n):
        recs = read_jsonl(run / f"peer{i}" / "metrics.jsonl")
        rounds = [RoundRecord.from_dict(r) for r in recs if RoundRecord.is_round(r)]
        ordinary = [r for r in rounds if r.started and not r.last]
        skipped += sum(not r.started for r in rounds)
        for r in rounds:
            if not r.started:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
        started += len(ordinary)
        totals = [r.wire_total for r in ordinary if r.wire_total is not None]
        if len(totals) >= 2:
            per_round.append((totals[-1] - totals[0]) / (len(totals) - 1))
        in_round += [r.wire_bytes for r in ordinary if r.wire_bytes is not None]
        by_peer.append([(r.sync_seconds, r.wire_bytes) for r in ordinary if r.wire_bytes])
        samples = links.samples(i + 1)
        (run / f"peer{i}").mkdir(exist_ok=True)
        with open(run / f"peer{i}" / "link.jsonl", "w") as f:  # the timeline, for reading rounds afterwards
            f.writelines(json.dumps(s) + "\n" for s in samples)
        for r in ordinary:
            if r.started_at is not None:
                uses.append(
                    link_use(samples, r.started_at, r.started_at + r.sync_seconds, args.mbit * 1e6 / 8)
                )
            for phase, s in r.phase_seconds.items():
                phases.setdefault(phase, []).append(s)
            for part, s in r.check_seconds.items():
                checks.setdefault(part, []).append(s)
            for part, s in r.startup_seconds.items():
                starts.setdefault(part, []).append(s)
            if r.startup_s is not None:
                startups.append(r.startup_s)
            if r.downloads_ended_s is not None:  # a refresh round
                for key in ("began", "ended", "waited"):
                    fetches.setdefault(key, []).append(getattr(r, f"downloads_{key}_s"))
        moved = sum(a - b for a, b in zip(after[i], before[i], strict=True))
        link.append(moved / max(1, len(ordinary)))
        for line in (run / f"peer{i}.log").read_text().splitlines():
            if line.startswith("{") and "final_val_loss" in line:
                losses.append(json.loads(line)["final_val_loss"])
    full = 2 * 2 * (n - 1) / n * model_bytes(cfg)
    bytes_per_round = statistics.mean(per_round) if per_round else float("nan")
    seconds = [round_ for rounds in by_peer for round_ in rounds]  # (round's seconds, its wire bytes)
    points = [(payload_s(b, args.mbit), s) for s, b in seconds]  # (payload's time, round's)
    link_s = link_ratios(by_peer, args.mbit)
    later_s = link_ratios(by_peer, args.mbit, skip_first=True)
    return {
        "bytes_per_round": int(bytes_per_round) if per_round else None,
        "round_bytes": int(statistics.mean(in_round)) if in_round else None,
        "link_bytes_per_round": int(statistics.mean(link)),
        "full_allreduce_bytes": int(full),
        "bytes_ratio": round(bytes_per_round / full, 4) if per_round else None,
        "round_vs_link": round(statistics.median(link_s), 3) if link_s else None,
        "round_vs_link_later": round(statistics.median(later_s), 3) if later_s else None,
        "round_s": round(statistics.median(s for s, _ in seconds), 2) if seconds else None,
        "phase_s": {p: round(statistics.median(v), 2) for p, v in phases.items()},
        "startup_s": round(statistics.median(startups), 2) if startups else None,
        "startup_parts_s": {p: round(statistics.median(v), 3) for p, v in starts.items()},
        "check_s": {p: round(statistics.median(v), 2) for p, v in checks.items()},
        "downloads_s": {k: round(statistics.median(v), 2) for k, v in fetches.items()},
        "round_fit": round_fit(points),
        "link_use": {
            k: round(statistics.median(getattr(u, k) for u in uses if u), 2)
            for k in ("busy", "head_s", "tail_s")
        }
        if any(uses)
        else None,
        "skipped_share": round(skipped / max(1, skipped + started), 3),
        "skipped_reasons": reasons,
        "val_loss": round(statistics.mean(losses), 4) if len(losses) == n else None,
        "rounds": started,
        "exit_codes": codes,
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = prepare_benchmark()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    base = Path(args.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    subprocess.run([sys.executable, "-m", "swarm.data.cli", "stdlib"], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip  # the corpus, built once before the peers race for it
    rows = []
    try:
        for shape in args.shapes:
            for codec in args.codecs:
                rtt = "" if args.rtt_ms is None else f", {args.rtt_ms:g} ms apart"
                print(f"{shape} / {codec}: {args.peers} peers at {args.mbit:g} Mbit/s{rtt}, {args.rounds} rounds",
                      file=sys.stderr, flush=True)  # fmt: skip
                row = {
                    "shape": shape,
                    "codec": codec,
                    "rtt_ms": args.rtt_ms,
                    "sysctl": args.sysctl,
                    **run_swarm(args, shape, codec, base / f"{shape}_{codec.replace('/', '+')}"),
                }
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                if row.get("interrupted"):
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        if rows and not args.json:
            print_table(rows, args)
        print("interrupted: every namespace and process made was removed", file=sys.stderr)
        return 130
    if not args.json:
        print_table(rows, args)
    return 0


def print_table(rows: list[dict], args) -> None:
    rtt = "no added latency" if args.rtt_ms is None else f"{args.rtt_ms:g} ms round trip"
    print(
        f"\n{args.peers} peers, links of {args.mbit:g} Mbit/s each way ({rtt}), {args.rounds} rounds per run"
    )
    head = f"{'shape':6} {'codec':5} {'MB/round':>9} {'in round':>9} {'link MB':>8} {'ratio':>6} "
    print(head + f"{'round s':>8} {'round/link':>10} {'skipped':>8} {'val loss':>9}  phases (median s)")

    def mb(v: float | None) -> str:
        return "n/a" if v is None else f"{v / 1e6:.1f}"

    for r in rows:
        phases = " ".join(f"{p} {s:g}" for p, s in r["phase_s"].items())
        if r["startup_s"] is not None:
            phases += f" (start-up {r['startup_s']:g})"
        if r["check_s"]:
            phases += " (checks: " + " ".join(f"{p} {s:g}" for p, s in r["check_s"].items()) + ")"
        if r["downloads_s"]:
            phases += " (downloads: " + " ".join(f"{k} {s:g}" for k, s in r["downloads_s"].items()) + ")"
        if r["link_use"]:
            use = r["link_use"]
            phases += f" (link: busy {use['busy']:g}, head {use['head_s']:g} s, tail {use['tail_s']:g} s)"
        if r["round_fit"]:
            fit = r["round_fit"]
            phases += f"; round = {fit['fixed_s']:g} s + {fit['per_payload']:g} x payload"
        print(f"{r['shape']:6} {r['codec']:5} {mb(r['bytes_per_round']):>9} {mb(r['round_bytes']):>9} "
              f"{r['link_bytes_per_round'] / 1e6:>8.1f} {r['bytes_ratio'] or float('nan'):>6.3f} "
              f"{r['round_s'] or float('nan'):>8.1f} {r['round_vs_link'] or float('nan'):>10.2f} "
              f"{r['skipped_share']:>8.0%} {r['val_loss'] or float('nan'):>9.4f}  {phases}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
