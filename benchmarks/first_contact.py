"""How long new peers' first all-reduce takes on links with latency, with the p2p daemon dialing from its
listening port (go-libp2p's default) and from fresh ports (what ``start_dht`` sets without NAT traversal).

    sudo python benchmarks/first_contact.py --rtt-ms 50 --trials 3      # needs root (network namespaces)
    sudo python benchmarks/first_contact.py --rtt-ms 0 --json           # the same links without delay

Each trial starts ``--peers`` fresh peers (``start_dht``, the first one the others' bootstrap), each in a
network namespace of its own on ``netns_links`` links (``--mbit``, ``--rtt-ms`` there and back), lets them
join for ``--settle-s`` seconds, and then has them all-reduce ``--values`` fp32 values in one hivemind group
at a shared moment (the timeouts of ``HivemindGroup``: requests 5 s, a sender 10 s, a reducer 20 s). Per arm:
how many trials' all-reduces succeeded on every peer, their median seconds, and how many failed security
handshakes the daemons logged ("noise: message is too short": two peers that dialed each other at the
same moment from their listening ports share one TCP connection on which both are the initiator; each then
backs off from dialing the other for seconds). ``--json`` prints one object per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.netns_links import ShapedLan, prepare_benchmark  # noqa: E402
from swarm.net.dht_node import REUSEPORT_ENV  # noqa: E402
from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets  # noqa: E402

ARMS = {"listening port (go-libp2p default)": "true", "fresh ports (swarm)": "false"}
HANDSHAKE_FAILED = "noise: message is too short"


def member(args: argparse.Namespace) -> None:
    """One peer: its DHT node, one averager, one all-reduce at ``--start-at``; prints a JSON line."""
    import hivemind
    import torch

    from swarm.net.dht_node import start_dht

    boot = Path(args.boot_file)
    if args.index == 0:
        dht = start_dht([], host=args.host)
        boot.write_text(str(dht.get_visible_maddrs()[0]))
    else:
        deadline = time.monotonic() + 30
        while not (boot.exists() and boot.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        dht = start_dht([boot.read_text().strip()], host=args.host)
    averager = hivemind.DecentralizedAverager(
        [torch.ones(args.values) * args.index], dht, prefix="first_contact", start=True,
        target_group_size=args.peers, min_group_size=args.peers, min_matchmaking_time=3.0,
        request_timeout=5.0, next_chunk_timeout=10.0, sender_timeout=10.0, reducer_timeout=20.0,
        allreduce_timeout=60.0,
    )  # fmt: skip
    time.sleep(max(0.0, args.start_at - time.time()))
    t0, ok, why = time.time(), False, ""
    try:
        gathered = averager.step(timeout=45.0, allow_retries=False)
        ok = gathered is not None and len(gathered) == args.peers
        why = "" if ok else f"a group of {len(gathered or ())}"
    except Exception as e:
        why = f"{type(e).__name__}: {e}"[:200]
    print(json.dumps({"ok": ok, "seconds": round(time.time() - t0, 2), "why": why}), flush=True)
    averager.shutdown()
    dht.shutdown()


def trial(args: argparse.Namespace, reuseport: str, work: Path) -> dict:
    env = {**os.environ, REUSEPORT_ENV: reuseport, "HIVEMIND_LOGLEVEL": "DEBUG"}  # the daemons' log lines
    with ShapedLan(args.peers, args.mbit, args.rtt_ms) as lan:
        start_at, procs = time.time() + args.settle_s, []
        boot = work / f"boot-{time.monotonic_ns()}"
        for i in range(args.peers):
            cmd = [sys.executable, __file__, "--member", "--index", str(i), "--host", lan.address(i),
                   "--boot-file", str(boot), "--start-at", str(start_at), "--peers", str(args.peers),
                   "--values", str(args.values)]  # fmt: skip
            err = open(work / f"peer{i}.log", "w")  # noqa: SIM115 (closed below, after the process ends)
            procs.append((subprocess.Popen(lan.command(i, cmd), stdout=subprocess.PIPE, stderr=err,
                                           text=True, env=env, start_new_session=True), err))  # fmt: skip
        results = []
        try:
            for p, err in procs:
                try:
                    out, _ = p.communicate(timeout=args.settle_s + 90)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate()
                err.close()
                lines = [ln for ln in out.splitlines() if ln.startswith("{")]
                results.append(
                    json.loads(lines[-1]) if lines else {"ok": False, "seconds": None, "why": "no result"}
                )
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    failed = sum(
        (work / f"peer{i}.log").read_text(errors="replace").count(HANDSHAKE_FAILED) for i in range(args.peers)
    )
    seconds = [r["seconds"] for r in results if r["seconds"] is not None]
    return {"ok": all(r["ok"] for r in results), "seconds": max(seconds) if seconds else None,
            "handshakes_failed": failed, "why": sorted({r["why"] for r in results if r["why"]})}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--values", type=int, default=1_321_089, help="fp32 values (default: the demo's dense weights)"
    )
    ap.add_argument("--settle-s", type=float, default=12.0, help="from the peers' start to their all-reduce")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--boot-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.member:
        member(args)
        return 0
    if args.peers < 2 or args.trials < 1 or not 0 <= args.rtt_ms <= 10_000:
        ap.error("needs --peers >= 2, --trials >= 1 and --rtt-ms in [0, 10000]")
    why = prepare_benchmark()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rows, sockets_before = [], p2p_sockets()
    with tempfile.TemporaryDirectory(prefix="first-contact-") as tmp:
        try:
            for t in range(args.trials):  # the arms alternate, so that a slow spell hits both
                for arm, reuseport in ARMS.items():
                    res = trial(args, reuseport, Path(tmp))
                    print(f"trial {t + 1}, {arm}: {res}", file=sys.stderr, flush=True)
                    rows.append((arm, res))
        except KeyboardInterrupt:
            print("interrupted: every namespace and process made was removed", file=sys.stderr)
            return 130
        finally:  # hivemind's averagers leave their client sockets behind (seen once their processes end)
            time.sleep(1.0)
            remove_stale_p2p_sockets(sockets_before)
    for arm in ARMS:
        runs = [r for a, r in rows if a == arm]
        secs = [r["seconds"] for r in runs if r["ok"]]
        row = {"arm": arm, "rtt_ms": args.rtt_ms, "peers": args.peers, "trials": len(runs),
               "ok": sum(r["ok"] for r in runs), "median_s": statistics.median(secs) if secs else None,
               "seconds": [r["seconds"] for r in runs],
               "handshakes_failed": [r["handshakes_failed"] for r in runs]}  # fmt: skip
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            med = "n/a" if row["median_s"] is None else f"{row['median_s']:.2f} s"
            print(f"{arm:>36}: {row['ok']}/{row['trials']} all-reduces ok, median {med}, seconds "
                  f"{row['seconds']}, failed handshakes {row['handshakes_failed']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
