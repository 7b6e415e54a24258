"""What heartbeats alone cost a peer as the swarm grows: DHT traffic per peer per heartbeat period.

    python benchmarks/heartbeats.py                       # 4, 8 and 16 peers, both crawls
    python benchmarks/heartbeats.py --peers 8 --json

For each swarm size N: a bootstrap node and N DHT nodes on 127.0.0.1, each with a peer's ``Membership``
at the demo config's timing (a heartbeat record published and every record read each period), no training
and no rounds. Once the swarm has settled (``--settle-s``), each node's p2pd I/O over ``--measure-s`` (sent
and received, ``TrafficMeter``) divided by the periods in it. Side by side in one run, on fresh nodes each:

- ``hivemind``: reads and writes crawl the DHT with hivemind's default beam (its bucket size, 20 nodes);
- ``swarm``: with ``hivemind_transport.CRAWL_BEAM`` (the nodes a record is stored on), as peers run.

Printed per size and crawl: the mean and the largest bytes per peer per period, the bootstrap's, and the
smallest view (how many peers the emptiest view held: N when every read found every record). ``--json``:
one object per line with the keys ``peers``, ``crawl``, ``mean_bytes``, ``max_bytes``, ``bootstrap_bytes``,
``min_view``; then one per size with ``peers`` and ``ratio`` (swarm's mean over hivemind's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import load_config  # noqa: E402
from swarm.net.dht_node import start_dht, visible_maddrs  # noqa: E402
from swarm.net.hivemind_transport import CRAWL_BEAM, HivemindStore  # noqa: E402
from swarm.net.membership import Membership  # noqa: E402
from swarm.net.timing import Timing  # noqa: E402
from swarm.net.traffic import TrafficMeter  # noqa: E402

CRAWLS = {"hivemind": None, "swarm": CRAWL_BEAM}


def measure(n: int, beam: int | None, timing: Timing, settle_s: float, measure_s: float) -> dict:
    boot = start_dht([])
    nodes, members = [], []
    try:
        nodes = [start_dht(visible_maddrs(boot)) for _ in range(n)]
        members = [
            Membership(
                HivemindStore(d, beam),
                d.peer_id.to_base58(),
                "heartbeats",
                timing,
                [i % 16],
                16,
                60.0,
                visible_maddrs(d),
            )
            for i, d in enumerate(nodes)
        ]
        meters = [TrafficMeter(d.pid) for d in [*nodes, boot]]
        time.sleep(settle_s)
        t0, before = time.monotonic(), [m.total() or 0 for m in meters]
        time.sleep(measure_s)
        periods = (time.monotonic() - t0) / timing.heartbeat_s
        per = [((m.total() or 0) - b) / periods for m, b in zip(meters, before, strict=True)]
        return {
            "mean_bytes": int(statistics.mean(per[:-1])),
            "max_bytes": int(max(per[:-1])),
            "bootstrap_bytes": int(per[-1]),
            "min_view": min(len(m.view.peers) for m in members),
        }
    finally:
        for m in members:
            m.close()
        for d in [*nodes, boot]:
            d.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="4,8,16", help="swarm sizes, comma-separated")
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"))
    ap.add_argument("--settle-s", type=float, default=12.0)
    ap.add_argument("--measure-s", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.peers.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        ap.error("--peers: one or more swarm sizes of 1 or more")
    timing = Timing.from_config(load_config(args.config).sync)
    if not args.json:
        print(f"heartbeat every {timing.heartbeat_s:g} s; bytes per peer per period, sent and received")
        print(f"{'peers':>5} {'crawl':>8} {'mean':>9} {'max':>9} {'bootstrap':>9} {'min view':>8}")
    for n in sizes:
        rows = {}
        for crawl, beam in CRAWLS.items():
            rows[crawl] = row = measure(n, beam, timing, args.settle_s, args.measure_s)
            if args.json:
                print(json.dumps({"peers": n, "crawl": crawl, **row}), flush=True)
            else:
                print(f"{n:>5} {crawl:>8} {row['mean_bytes'] / 1e3:>7.0f}kB {row['max_bytes'] / 1e3:>7.0f}kB "
                      f"{row['bootstrap_bytes'] / 1e3:>7.0f}kB {row['min_view']:>8}", flush=True)  # fmt: skip
        ratio = rows["swarm"]["mean_bytes"] / max(1, rows["hivemind"]["mean_bytes"])
        print(
            json.dumps({"peers": n, "ratio": round(ratio, 3)}) if args.json else f"{n:>5} ratio {ratio:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
