"""``swarm-bootstrap``: a long-lived DHT node that new peers join through. It trains nothing.

    swarm-bootstrap [--host 127.0.0.1] [--port 31337] [--identity bootstrap.id] [--config configs/demo.yaml]
                    [--dashboard-port 8080 [--dashboard-host 127.0.0.1]]
                    [--new-swarm] [--swarm-key swarm.key [--allow-peers peers.txt]]

It prints its multiaddrs and the exact ``swarm-peer`` command to join, then serves until Ctrl+C or SIGTERM,
when it shuts its DHT node down cleanly. With ``--identity`` its peer id (and so its address) survives
restarts. It listens on 127.0.0.1 unless told otherwise; NAT traversal and relays only with ``--use-nat``.
With ``--dashboard-port`` it also serves the swarm's dashboard (``swarm-dashboard``'s page, ``/api/state``
and ``/metrics``) for the run of ``--config``, read through its own DHT node. ``--new-swarm`` writes a new
swarm key to ``--swarm-key`` (default ``swarm.key``); with a key, only nodes that hold it take part
(``swarm.net.swarm_key``), and the printed join command names it.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from http.server import ThreadingHTTPServer

from swarm.config import ConfigError
from swarm.dashboard.server import Dashboard, bind
from swarm.dashboard.swarm_view import ViewConfig
from swarm.net.swarm_key import (
    SwarmKey,
    SwarmKeyError,
    add_swarm_key_args,
    swarm_key_args,
    swarm_key_from_args,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-bootstrap", description="Run a bootstrap DHT node for a swarm.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    ap.add_argument("--announce-host", default=None, help="public address to announce, if different")
    ap.add_argument("--identity", default=None, metavar="FILE", help="private key file: a stable peer id")
    ap.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="other bootstrap peers")
    ap.add_argument("--use-nat", action="store_true", help="enable UPnP, AutoNAT and relays (off by default)")
    ap.add_argument("--new-swarm", action="store_true", help="write a new swarm key (to --swarm-key) first")
    add_swarm_key_args(ap)
    ap.add_argument(
        "--config", default="configs/demo.yaml", help="config named in the join command; the dashboard's run"
    )
    ap.add_argument(
        "--dashboard-port", type=int, default=0, metavar="N", help="serve the dashboard on port N (0: off)"
    )
    ap.add_argument(
        "--dashboard-host", default="127.0.0.1", help="address of the dashboard (default loopback)"
    )
    return ap.parse_args(argv)


def _bind_dashboard(args: argparse.Namespace) -> tuple[ViewConfig, ThreadingHTTPServer]:
    if not 0 < args.dashboard_port <= 65535:
        raise ValueError("--dashboard-port must be in [1, 65535] (0: no dashboard)")
    return ViewConfig.from_config_file(args.config), bind(args.dashboard_host, args.dashboard_port)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.port <= 65535:
        print("error: --port must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        if args.new_swarm:
            args.swarm_key = args.swarm_key or "swarm.key"
            SwarmKey.create().write(args.swarm_key)
            print(
                f"new swarm key written to {args.swarm_key}: give it to every peer (--swarm-key)", flush=True
            )
        swarm_key = swarm_key_from_args(args)
    except SwarmKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    view_cfg, http = None, None
    if args.dashboard_port:
        try:  # before the DHT: bad input fails fast, with nothing to shut down
            view_cfg, http = _bind_dashboard(args)
        except (ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from swarm.net.dht_node import DHTStartError, start_dht, visible_maddrs  # hivemind: seconds to import

    try:
        dht = start_dht(
            args.initial_peers,
            host=args.host,
            port=args.port,
            identity_path=args.identity,
            use_nat=args.use_nat,
            announce_host=args.announce_host,
            swarm_key=swarm_key,
        )
    except DHTStartError as e:
        if http is not None:
            http.server_close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    dashboard = Dashboard.start(dht, view_cfg, server=http) if view_cfg is not None else None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    maddrs = visible_maddrs(dht)
    key = f"swarm key {swarm_key.key_id}" if swarm_key else "no swarm key: anyone who reaches it may join"
    print(f"bootstrap peer is up ({key}); its addresses:")
    for m in maddrs:
        print(f"  {m}")
    join = ["swarm-peer", "--config", args.config, "--initial-peers", *maddrs, *swarm_key_args(args)]
    join += ["--run-dir", "runs/peer1"]
    print("join the swarm with:")
    print("  " + shlex.join(join))
    if dashboard is not None:
        print(f"dashboard: {dashboard.url} (run {view_cfg.run_id})")
    sys.stdout.flush()
    try:
        while not stop.wait(1.0):
            if not dht.is_alive():
                print("error: the DHT process died", file=sys.stderr)
                return 1
    finally:
        if dashboard is not None:
            dashboard.close()
        dht.shutdown()
        dht.join(timeout=10)
    print("bootstrap peer stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
