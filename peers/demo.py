"""``swarm-demo``: a whole swarm on this machine. A bootstrap peer and N peers on 127.0.0.1 train the demo
model on the embedded corpus, synchronise, and stop together; then a summary.

    swarm-demo [--peers 4] [--minutes 5] [--run-dir runs/swarm-demo] [--config FILE] [--dashboard-port 8080]

The config is configs/demo.yaml (sized for a few CPU cores) unless a CUDA device is available, then
configs/demo-gpu.yaml (a larger model that the N peers train together on one shared GPU); ``--config``
overrides the choice, and the demo prints which one it runs.

The bootstrap peer also serves the dashboard (a live page of the swarm; its URL is printed), on port 8080,
or on a free port when 8080 is taken; ``--dashboard-port 0`` turns it off. Every process is started here,
watched, and reaped by PID; their logs are in the run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from swarm.config import ConfigError, load_config, save_config
from swarm.train.round_record import RoundRecord

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DASHBOARD_PORT = 8080
CPU_CONFIG = ROOT / "configs" / "demo.yaml"
GPU_CONFIG = ROOT / "configs" / "demo-gpu.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-demo", description="Run a small swarm on this machine.")
    ap.add_argument("--peers", type=int, default=4, help="number of training peers (default 4)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time of every peer (default 5)")
    ap.add_argument("--run-dir", default="runs/swarm-demo", help="logs, metrics and checkpoints of each peer")
    ap.add_argument(
        "--config",
        default=None,
        help="run config (default: configs/demo-gpu.yaml with a CUDA device, else configs/demo.yaml)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides for every peer"
    )
    ap.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        metavar="N",
        help="port of the dashboard (default 8080, or a free port if taken; 0: no dashboard)",
    )
    return ap.parse_args(argv)


def pick_config(explicit: str | None) -> tuple[str, str]:
    """The config file to run and why: ``--config`` when given, else the GPU preset when torch sees a CUDA
    device (the CPU preset finishes in well under a minute on one), else the CPU preset."""
    if explicit:
        return explicit, "given by --config"
    import torch  # only here: the demo itself never touches the device (no CUDA context in this process)

    if torch.cuda.is_available():
        return str(GPU_CONFIG), f"{torch.cuda.device_count()} CUDA device(s) available"
    return str(CPU_CONFIG), "no CUDA device"


def dashboard_port(wanted: int | None) -> int:
    """The port to give the bootstrap peer: as asked, else 8080 when it is free, else any free port."""
    if wanted is not None:
        return wanted
    for port in (DEFAULT_DASHBOARD_PORT, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port for the dashboard")


def _read(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _progress(run_dirs: list[Path], t0: float) -> str:
    parts = []
    for i, d in enumerate(run_dirs):
        recs = _read(d / "metrics.jsonl")
        steps = [r for r in recs if "loss" in r]
        rounds = [r for r in recs if RoundRecord.is_round(r) and RoundRecord.from_dict(r).started]
        if steps:
            parts.append(f"p{i} step {steps[-1]['step']} loss {steps[-1]['loss']:.2f} rounds {len(rounds)}")
        else:
            parts.append(f"p{i} starting")
    return f"[{time.monotonic() - t0:5.0f}s] " + " | ".join(parts)


def summarize(run_dirs: list[Path], n_experts: int) -> dict:
    """Per-peer validation loss, expert coverage, rounds completed and bytes per round."""
    peers, holders = [], {e: 0 for e in range(n_experts)}
    for i, d in enumerate(run_dirs):
        recs = _read(d / "metrics.jsonl")
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        rounds = [RoundRecord.from_dict(r) for r in recs if RoundRecord.is_round(r)]
        rounds = [r for r in rounds if r.started]
        ok = [r for r in rounds if r.clean]
        per_round = [r.wire_bytes for r in ok if r.wire_bytes is not None]
        state = {}
        ckpts = sorted((d / "checkpoints").glob("step_*/state.json"))
        if ckpts:
            state = json.loads(ckpts[-1].read_text())
        experts = state.get("local_experts", [])
        for e in experts:
            holders[e] += 1
        peers.append(
            {
                "peer": i,
                "experts": experts,
                "steps": state.get("step"),
                "val_loss_first": val[0] if val else None,
                "val_loss_last": val[-1] if val else None,
                "rounds": len(rounds),
                "rounds_clean": len(ok),
                "bytes_per_round": int(sum(per_round) / len(per_round)) if per_round else 0,
            }
        )
    covered = sum(1 for c in holders.values() if c > 0)
    return {
        "peers": peers,
        "experts_covered": covered,
        "n_experts": n_experts,
        "holders": holders,
        "replicas": replica_spread(run_dirs, [p["experts"] for p in peers]),
        "predicted_bytes_per_round": predicted_bytes(run_dirs, holders, [p["experts"] for p in peers]),
    }


def predicted_bytes(run_dirs: list[Path], holders: dict[int, int], experts: list[list[int]]) -> int | None:
    """What the design predicts a peer moves per round (sent + received, mean over peers): the dense
    all-reduce (butterfly: 2(n-1)/n of the dense bytes sent and as much received); each own expert's
    all-reduce among its h holders, 4(h-1)/h of its bytes; and non-local downloads in fp16, counted once by
    the peer that receives and once by the one that serves."""
    from safetensors import safe_open

    from swarm.train.checkpoint import latest_checkpoint

    path = latest_checkpoint(run_dirs[0] / "checkpoints")
    if path is None:
        return None
    dense = expert = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            numel = math.prod(shape)
            if ".experts." in key:
                expert += 4 * numel // shape[0]
            else:
                dense += 4 * numel
    n = len(run_dirs)
    own = sum(h * 4 * (h - 1) / h * expert for h in holders.values() if h > 0) / n
    downloads = 2 * sum((len(holders) - len(ex)) * expert / 2 for ex in experts) / n
    return int(4 * (n - 1) / n * dense + own + downloads)


def replica_spread(run_dirs: list[Path], experts: list[list[int]]) -> dict:
    """Largest absolute difference, across peers' final checkpoints, of the dense weights; of each expert
    among its holders; and of every peer's copy of a non-local expert against a holder's."""
    from safetensors.torch import load_file

    from swarm.train.checkpoint import latest_checkpoint

    models = []
    for d in run_dirs:
        path = latest_checkpoint(d / "checkpoints")
        models.append(load_file(str(path / "model.safetensors")) if path else None)
    if any(m is None for m in models) or len(models) < 2:
        return {}
    spread = {"dense": 0.0, "expert_replicas": 0.0, "non_local_copies": 0.0}
    for key, ref in models[0].items():
        if ".experts." not in key:
            spread["dense"] = max(spread["dense"], *((m[key] - ref).abs().max().item() for m in models[1:]))
            continue
        for e in range(ref.shape[0]):
            holders = [i for i, ex in enumerate(experts) if e in ex]
            if not holders:
                continue
            base = models[holders[0]][key][e]
            for i, m in enumerate(models):
                diff = (m[key][e] - base).abs().max().item()
                slot = "expert_replicas" if i in holders else "non_local_copies"
                spread[slot] = max(spread[slot], diff)
    return spread


def _print_summary(s: dict, formed_s: float | None) -> None:
    print("\n=== swarm summary ===")
    if formed_s is not None:
        print(f"swarm formed in {formed_s:.1f} s (every peer joined)")
    for p in s["peers"]:
        a, b = p["val_loss_first"], p["val_loss_last"]
        loss = f"{a:.3f} -> {b:.3f}" if a is not None and b is not None else "n/a"
        print(
            f"peer {p['peer']}: experts {p['experts']}, {p['steps']} steps, val loss {loss}, "
            f"rounds {p['rounds']} ({p['rounds_clean']} clean), {p['bytes_per_round'] / 1e6:.2f} MB per round (measured)"
        )
    if s.get("replicas"):
        r = s["replicas"]
        print(
            f"replica agreement after the last round (max |difference|): dense {r['dense']:.2e}, "
            f"expert replicas {r['expert_replicas']:.2e}, non-local copies {r['non_local_copies']:.2e} (fp16 wire)"
        )
    pred = s.get("predicted_bytes_per_round")
    measured = [p["bytes_per_round"] for p in s["peers"] if p["bytes_per_round"]]
    if pred and measured:
        mean = sum(measured) / len(measured)
        print(
            f"bytes per peer per round: measured {mean / 1e6:.2f} MB (I/O of each peer's p2pd, mean over "
            f"peers), design predicts {pred / 1e6:.2f} MB: ratio {mean / pred:.2f}"
        )
    missing = [e for e, c in s["holders"].items() if c == 0]
    print(
        f"experts covered: {s['experts_covered']}/{s['n_experts']}"
        + (f" (uncovered: {missing})" if missing else "")
    )


def _stop(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """SIGTERM to every process at once (each writes its checkpoint and leaves), then one shared bound;
    a process still running after it is killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline, codes = time.monotonic() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(timeout=10))
    return codes


def _interrupt(signum, frame):  # SIGTERM stops the demo like Ctrl+C: the peers checkpoint and leave
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.config, why = pick_config(args.config)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.peers < 1 or args.minutes <= 0:
        print("error: --peers must be >= 1 and --minutes > 0", file=sys.stderr)
        return 2
    if args.dashboard_port is not None and not 0 <= args.dashboard_port <= 65535:
        print("error: --dashboard-port must be in [0, 65535] (0: no dashboard)", file=sys.stderr)
        return 2
    board_port = dashboard_port(args.dashboard_port)
    print(f"config: {args.config} ({why})", flush=True)
    run = Path(args.run_dir)
    if run.exists() and any(run.iterdir()):
        print(f"error: {run} is not empty; choose another --run-dir or remove it", file=sys.stderr)
        return 2
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    # build the corpus once, before the peers race for it
    subprocess.run(
        [py, "-m", "swarm.data.cli", "stdlib", "--vocab-size", str(cfg.data.stdlib_vocab_size)],
        cwd=ROOT,
        env=env,
        check=True,
    )
    effective = run / "config.yaml"  # with the --set overrides: the dashboard watches this run id
    save_config(cfg, effective)
    boot_log = open(run / "bootstrap.log", "w")
    signal.signal(signal.SIGTERM, _interrupt)
    stop_bound = cfg.sync.round_timeout_s + 10  # a peer's own bound: a round in flight, then leaving
    interrupted = False
    boot = subprocess.Popen(
        [py, "-m", "bootstrap.main", "--config", str(effective), "--dashboard-port", str(board_port)],
        cwd=ROOT,
        env=env,
        stdout=boot_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    peers: list[subprocess.Popen] = []
    run_dirs = [run / f"peer{i}" for i in range(args.peers)]
    try:
        maddr = wait_for_maddr(run / "bootstrap.log", boot)
        print(f"bootstrap peer: {maddr}")
        if board_port:
            print(f"dashboard: {dashboard_url(run / 'bootstrap.log')} (open it in a browser)", flush=True)
        t0 = time.monotonic()
        threads = max(1, (os.cpu_count() or 1) // args.peers)
        # one wall time for all: the peers stop together and meet for their last round
        stop_at = time.time() + 15 + 60 * args.minutes
        for i, d in enumerate(run_dirs):
            cmd = [
                py,
                "-m",
                "peers.main",
                "--config",
                args.config,
                "--initial-peers",
                maddr,
                "--run-dir",
                str(d),
                "--stop-at",
                str(stop_at),
                "--no-progress",
                "--set",
                f"train.threads={threads}",
            ]
            for item in args.set:
                cmd += ["--set", item]
            log = open(run / f"peer{i}.log", "w")
            # a session of their own: a Ctrl+C in the terminal reaches the demo only, which stops each peer
            # with exactly one signal (a second one would cut its checkpoint short)
            peers.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        formed = _wait_formed(run, args.peers, peers, t0)
        print(f"swarm formed in {formed:.1f} s" if formed is not None else "swarm did not form in 60 s")
        last = 0.0
        while any(p.poll() is None for p in peers):
            if time.monotonic() - last > 15:
                print(_progress(run_dirs, t0), flush=True)
                last = time.monotonic()
            time.sleep(1)
        codes = [p.returncode for p in peers]
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the peers (they write checkpoints)", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one interruption is enough: let them finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(peers, stop_bound)
        codes, formed, interrupted = [], None, True
    finally:
        _stop(peers, stop_bound)
        _stop([boot], 15)
    summary = summarize(run_dirs, cfg.model.n_experts)
    _print_summary(summary, formed)
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    if interrupted:
        return 130
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        print(
            f"peers {bad} exited with codes {[codes[i] for i in bad]}; see {run}/peer*.log", file=sys.stderr
        )
        return 1
    return 0


def wait_for_maddr(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.strip().startswith("/ip") and "/p2p/" in line:
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the bootstrap peer exited ({proc.returncode}); see {log}")
        time.sleep(0.2)
    raise TimeoutError("the bootstrap peer did not start in time")


def dashboard_url(log: Path) -> str:
    """The dashboard URL the bootstrap peer prints (with its addresses, so it is there already)."""
    for line in log.read_text().splitlines():
        if line.startswith("dashboard: "):
            return line.split()[1]
    return "not started (see bootstrap.log)"


def _wait_formed(
    run: Path, n: int, peers: list[subprocess.Popen], t0: float, timeout: float = 60
) -> float | None:
    """Seconds until every peer has joined (printed its 'joined run' line)."""
    while time.monotonic() - t0 < timeout:
        joined = sum("joined run" in (run / f"peer{i}.log").read_text() for i in range(n))
        if joined == n:
            return time.monotonic() - t0
        if any(p.poll() is not None for p in peers):
            return None
        time.sleep(0.2)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
