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
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from peers.demo_summary import print_summary, read_jsonl, summarize
from swarm.config import ConfigError, load_config, save_config
from swarm.sync.codecs import codec_named
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


def _progress(run_dirs: list[Path], t0: float) -> str:
    parts = []
    for i, d in enumerate(run_dirs):
        recs = read_jsonl(d / "metrics.jsonl")
        steps = [r for r in recs if "loss" in r]
        rounds = [r for r in recs if RoundRecord.is_round(r) and RoundRecord.from_dict(r).started]
        if steps:
            parts.append(f"p{i} step {steps[-1]['step']} loss {steps[-1]['loss']:.2f} rounds {len(rounds)}")
        else:
            parts.append(f"p{i} starting")
    return f"[{time.monotonic() - t0:5.0f}s] " + " | ".join(parts)


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
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started as a background job
    stop_bound = cfg.sync.round_timeout_s + 10  # a peer's own bound: a round in flight, then leaving
    interrupted = False
    key = run / "swarm.key"  # the demo's swarm is closed to anyone without it (the bootstrap writes it)
    boot = subprocess.Popen(
        [py, "-m", "bootstrap.main", "--config", str(effective), "--dashboard-port", str(board_port)]
        + ["--new-swarm", "--swarm-key", str(key)],
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
                "--swarm-key",
                str(key),
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
    codec = codec_named(cfg.sync.codec)
    summary = summarize(
        run_dirs,
        cfg.model.n_experts,
        codec,
        codec_named(cfg.sync.dense_codec_name),
        cfg.sync.refresh_every,
        cfg.sync.embeddings_every,
    )
    print_summary(summary, formed)
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
