"""``swarm-dashboard``: a live web page of a swarm, its JSON API and Prometheus metrics.

    swarm-dashboard --initial-peers MADDR [--port 8080] [--host 127.0.0.1] [--config configs/demo.yaml]
    swarm-dashboard --initial-peers MADDR --run-id myrun --experts 64 --port 0     # any free port

It joins the DHT as a client (it serves no DHT requests and publishes nothing), reads the run's heartbeat
records every ``--poll-s`` seconds and serves ``/`` (the page), ``/api/state`` (JSON) and ``/metrics``
(Prometheus) until Ctrl+C or SIGTERM, when it shuts down cleanly. The run id and the expert count come from
``--config`` (default: the demo config); ``--run-id`` and ``--experts`` override them. Bad input (port,
config, unreachable peers) prints one ``error:`` line and exits with code 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from swarm.config import ConfigError
from swarm.dashboard.server import Dashboard, DashboardBindError, bind
from swarm.dashboard.swarm_view import ViewConfig
from swarm.net.swarm_key import SwarmKeyError, add_swarm_key_args, swarm_key_from_args

EXIT_BAD_INPUT = 2
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-dashboard", description="Serve a live status page of a swarm.")
    ap.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="peers to join through"
    )
    ap.add_argument("--host", default="127.0.0.1", help="address the page is served on (default: loopback)")
    ap.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: any free port)")
    ap.add_argument("--config", default=None, help="run config giving the run id and expert count")
    ap.add_argument("--run-id", default=None, help="run to watch (default: the config's, else 'demo')")
    ap.add_argument("--experts", type=int, default=None, help="experts in the model (default: the config's)")
    ap.add_argument("--poll-s", type=float, default=2.0, help="seconds between DHT reads (default 2)")
    ap.add_argument("--history", type=int, default=900, help="samples kept for the charts (default 900)")
    add_swarm_key_args(ap)
    return ap.parse_args(argv)


def view_config(args: argparse.Namespace) -> ViewConfig:
    """The run to watch: from --config (or the demo config when it is there), with overrides."""
    kw = {"poll_s": args.poll_s, "history_samples": args.history}
    path = args.config or (str(DEMO_CONFIG) if DEMO_CONFIG.exists() else None)
    if path is not None:
        cfg = ViewConfig.from_config_file(path, run_id=args.run_id, **kw)
    else:
        cfg = ViewConfig(run_id=args.run_id or "demo", **kw)
    if args.experts is not None:
        cfg = ViewConfig(**{**vars(cfg), "n_experts": args.experts})
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 <= args.port <= 65535:
        print("error: --port must be in [0, 65535]", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cfg = view_config(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        swarm_key = swarm_key_from_args(args)
    except SwarmKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        server = bind(args.host, args.port)  # a taken port fails before the DHT is started
    except DashboardBindError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from swarm.net.dht_node import DHTStartError, start_dht  # imports hivemind: only once input is good

    stop = threading.Event()  # set before the DHT starts: a Ctrl+C then still shuts it down cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        dht = start_dht(args.initial_peers, client_mode=True, swarm_key=swarm_key)
    except DHTStartError as e:
        server.server_close()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    dashboard = Dashboard.start(dht, cfg, server=server)
    experts = cfg.n_experts if cfg.n_experts is not None else "? (from the records)"
    print(f"dashboard: {dashboard.url} (run {cfg.run_id}, {experts} experts)", flush=True)
    code = 0
    try:
        while not stop.wait(1.0):
            if not dht.is_alive():
                print("error: the DHT process died", file=sys.stderr)
                code = 1
                break
    finally:
        dashboard.close()
        dht.shutdown()
        dht.join(timeout=10)
    print("dashboard stopped", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
