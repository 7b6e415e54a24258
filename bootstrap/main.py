"""``swarm-bootstrap``: a long-lived DHT node that new peers join through. It trains nothing.

    swarm-bootstrap [--host 127.0.0.1] [--port 31337] [--identity bootstrap.id] [--config configs/demo.yaml]

It prints its multiaddrs and the exact ``swarm-peer`` command to join, then serves until Ctrl+C or SIGTERM,
when it shuts its DHT node down cleanly. With ``--identity`` its peer id (and so its address) survives
restarts. It listens on 127.0.0.1 unless told otherwise; NAT traversal and relays only with ``--use-nat``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from swarm.net.dht_node import DHTStartError, start_dht, visible_maddrs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-bootstrap", description="Run a bootstrap DHT node for a swarm.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    ap.add_argument("--announce-host", default=None, help="public address to announce, if different")
    ap.add_argument("--identity", default=None, metavar="FILE", help="private key file: a stable peer id")
    ap.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="other bootstrap peers")
    ap.add_argument("--use-nat", action="store_true", help="enable UPnP, AutoNAT and relays (off by default)")
    ap.add_argument("--config", default="configs/demo.yaml", help="config named in the printed join command")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.port <= 65535:
        print("error: --port must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        dht = start_dht(
            args.initial_peers,
            host=args.host,
            port=args.port,
            identity_path=args.identity,
            use_nat=args.use_nat,
            announce_host=args.announce_host,
        )
    except DHTStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    maddrs = visible_maddrs(dht)
    print("bootstrap peer is up; its addresses:")
    for m in maddrs:
        print(f"  {m}")
    join = ["swarm-peer", "--config", args.config, "--initial-peers", *maddrs, "--run-dir", "runs/peer1"]
    print("join the swarm with:")
    print("  " + shlex.join(join), flush=True)
    try:
        while not stop.wait(1.0):
            if not dht.is_alive():
                print("error: the DHT process died", file=sys.stderr)
                return 1
    finally:
        dht.shutdown()
        dht.join(timeout=10)
    print("bootstrap peer stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
