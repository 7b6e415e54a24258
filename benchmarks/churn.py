"""Issue 15's churn scenario, re-run with real processes on 127.0.0.1 (or on shaped links with latency).

    python benchmarks/churn.py [--peers 4] [--kill-after 130] [--down 30] [--minutes 6] [--json]
                               [--config configs/demo.yaml] [--set key=value ...]
    sudo python benchmarks/churn.py --rtt-ms 50 [--mbit 100]   # each process in a network namespace

Two bootstrap peers (B joined through A); N peers given both addresses, sharing one stop time. After
``--kill-after`` seconds, peer 1 (the sole holder of its experts at the demo's r = 1) is killed with
SIGKILL, process group and all; ``--down`` seconds later it is restarted with ``--resume`` from the same run
directory; then bootstrap A is killed with SIGKILL and a further peer joins with ``--initial-peers A B``.
Every process is stopped by PID at the end, and its exit code checked. With ``--rtt-ms``, every process
(bootstraps, peers, the joiner) runs in a network namespace of its own on ``netns_links`` links of
``--mbit`` with that round trip between any two (``wan.py``'s network; needs root).

Printed (one JSON object with ``--json``): the restarted peer's catch-up line, the age of the checkpoint it
resumed from at the moment of the kill (against ``train.checkpoint_every_s``), its step then and after,
whether it kept its peer id, its validation loss right after catch-up next to each live peer's latest, the
joiner's catch-up line, every exit code, and how far the final dense weights of the peers that ended
together are apart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _lines(path: Path, prefix: str) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.startswith(prefix)] if path.exists() else []


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def run(args: argparse.Namespace, work: Path) -> dict:
    from peers.demo import wait_for_maddr
    from swarm.config import load_config
    from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets
    from swarm.train.checkpoint import latest_checkpoint, load_checkpoint

    py, env = sys.executable, {**os.environ, "PYTHONUNBUFFERED": "1"}
    cfg = load_config(args.config, args.set)
    subprocess.run([py, "-m", "swarm.data.cli", "stdlib", "--vocab-size", str(cfg.data.stdlib_vocab_size)],
                   cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip
    procs: dict[str, subprocess.Popen] = {}
    sockets_before = p2p_sockets()

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        with open(work / f"{name}.log", "a") as log:
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
        return procs[name]

    threads = max(1, (os.cpu_count() or 1) // (args.peers + 1))  # as swarm-demo: no core oversubscribed
    sets = ["--set", f"train.threads={threads}", *(a for kv in args.set for a in ("--set", kv))]
    sets += ["--set", f"run_id=churn-{os.getpid()}"]
    lan = None
    if args.rtt_ms is not None:  # hosts: bootstraps A and B, the peers, the joiner
        from benchmarks.netns_links import ShapedLan

        lan = ShapedLan(args.peers + 3, args.mbit, args.rtt_ms).__enter__()

    def on(host: int, cmd: list[str]) -> list[str]:
        return cmd if lan is None else lan.command(host, [*cmd, "--host", lan.address(host)])

    try:
        a = wait_for_maddr(work / "boot_a.log", start("boot_a", on(0, [py, "-m", "bootstrap.main"])))
        b = wait_for_maddr(
            work / "boot_b.log", start("boot_b", on(1, [py, "-m", "bootstrap.main", "--initial-peers", a]))
        )
        t0 = time.time()
        stop_at = t0 + 60 * args.minutes

        def peer(i: int, *extra: str) -> subprocess.Popen:
            return start(f"peer{i}", on(i + 2, [py, "-m", "peers.main", "--config", args.config,
                                                "--initial-peers", a, b, "--run-dir", str(work / f"peer{i}"),
                                                "--stop-at", str(stop_at), "--no-progress", *sets, *extra]))  # fmt: skip

        for i in range(args.peers):
            peer(i)
        time.sleep(max(0.0, t0 + args.kill_after - time.time()))
        victim = procs["peer1"]
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        killed = time.time()
        ckpt_path = latest_checkpoint(work / "peer1" / "checkpoints")
        ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
        ckpt_age = killed - (ckpt_path / "state.json").stat().st_mtime if ckpt_path else None
        last_step = max((r["step"] for r in _metrics(work / "peer1") if "loss" in r), default=0)
        time.sleep(args.down)
        procs["peer1_killed"] = procs.pop("peer1")
        peer(1, "--resume")
        deadline = time.time() + 120
        while time.time() < deadline and not _lines(work / "peer1.log", "caught up with the swarm"):
            time.sleep(1)
        os.killpg(procs["boot_a"].pid, signal.SIGKILL)
        procs["boot_a"].wait()
        peer(args.peers)  # the late joiner: A is dead, B is not
        codes = {}
        for name in [f"peer{i}" for i in range(args.peers + 1)]:
            codes[name] = procs[name].wait(
                timeout=max(1.0, stop_at - time.time() + cfg.sync.round_timeout_s + 120)
            )
    finally:
        _stop(list(procs.values()))
        remove_stale_p2p_sockets(sockets_before)  # the SIGKILLed peer's and bootstrap's
        if lan is not None:
            lan.close()
    return _report(work, args, cfg, ckpt, ckpt_age, last_step, codes)


def _report(work: Path, args, cfg, ckpt, ckpt_age, last_step, codes) -> dict:
    import torch

    from swarm.train.checkpoint import latest_checkpoint, load_checkpoint

    ids = [ln.split()[2].rstrip(";") for ln in _lines(work / "peer1.log", "peer id: ")]
    back = [r for r in _metrics(work / "peer1") if "val_loss" in r and "loss" not in r and r["step"] > 0]
    after = back[0] if back else {}
    live, around = {}, {}
    for i in [i for i in range(args.peers) if i != 1]:
        # each live peer's evaluations just before and just after that one: the restarted peer is measured
        # on what it fetched from the swarm's latest round, which can be newer than a live peer's last
        # evaluation (evaluations are `val_every` steps apart), so "then" lies between the two
        vals = [r for r in _metrics(work / f"peer{i}") if "val_loss" in r]
        before = [r for r in vals if r.get("time", 0) <= after.get("time", 0)]
        later = [r for r in vals if r.get("time", 0) > after.get("time", 0)]
        live[f"peer{i}"] = before[-1]["val_loss"] if before else None
        around[f"peer{i}"] = [[r["step"], round(r["val_loss"], 4)] for r in (before[-1:] + later[:1])]
    ended = [i for i in range(args.peers + 1) if codes.get(f"peer{i}") == 0]
    dense = [load_checkpoint(latest_checkpoint(work / f"peer{i}" / "checkpoints")).model for i in ended]
    spread = max(
        (float((d[k] - dense[0][k]).abs().max()) for d in dense[1:] for k in d if ".experts." not in k),
        default=0.0,
    )
    restarted = (_lines(work / "peer1.log", "caught up with the swarm") or [""])[0]
    return {
        "restarted_caught_up": restarted,
        "checkpoint_step": ckpt.step if ckpt else None,
        "checkpoint_age_at_kill_s": round(ckpt_age, 1) if ckpt_age is not None else None,
        "checkpoint_every_s": cfg.train.checkpoint_every_s,
        "step_at_kill": last_step,
        "same_peer_id": len(ids) == 2 and ids[0] == ids[1],
        "restarted_val_loss_after_catch_up": after.get("val_loss"),
        "restarted_step_after_catch_up": after.get("step"),
        "live_val_loss_then": live,
        "live_val_loss_around": around,
        "joiner_caught_up": (_lines(work / f"peer{args.peers}.log", "caught up with the swarm") or [""])[0],
        "exit_codes": codes,
        "final_dense_max_diff": spread,
        "rtt_ms": args.rtt_ms,
        "torch": torch.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--kill-after", type=float, default=130.0, help="seconds after the peers start")
    ap.add_argument("--down", type=float, default=30.0, help="seconds before the killed peer restarts")
    ap.add_argument("--minutes", type=float, default=6.0, help="until the shared stop")
    ap.add_argument("--rtt-ms", type=float, default=None, help="links with this round trip (needs root)")
    ap.add_argument("--mbit", type=float, default=100.0, help="with --rtt-ms: each link's rate each way")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    args = ap.parse_args()
    if args.rtt_ms is not None:
        from benchmarks.netns_links import prepare_benchmark

        why = prepare_benchmark()  # from here SIGTERM stops the run through its cleanup
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="swarm-churn-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        row = run(args, work)
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
