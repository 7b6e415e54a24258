"""How fast a served copy moves between two shaped hosts, against plain TCP on the same links.

    sudo python benchmarks/stream_rate.py                   # 4 hosts, 20 MB at 100 Mbit/s, 1 and 4 streams
    sudo python benchmarks/stream_rate.py --streams 1,2,8 --json

``--hosts`` hosts (default 4), each in a network namespace of its own on links shaped with ``tc``
(``netns_links``: tbf in each direction, no added latency), and a bootstrap DHT node. Each host serves
copies through the project's hivemind transport (``HivemindTransport.fetch``, what expert downloads use),
and runs a TCP server. Then, one case at a time, at the same moment on every host taking part, each taker
takes ``--mb`` MB in all:

- ``tcp_one_way`` / ``p2p_one_way``: host 1 takes from host 0, which only sends;
- ``tcp_both_ways`` / ``p2p_both_ways``: hosts 0 and 1 each take from the other at once;
- ``tcp_all_to_all`` / ``p2p_all_to_all``: every host takes a share from every other at once, as a swarm
  round's downloads go (each peer serves its experts to all while it downloads theirs).

p2p cases run with each count of ``--streams``: that many parallel fetches per pair, each of a share.

Per case it prints the rate each taker got (MB/s, median over ``--repeats``) and that over the link's rate
(``--mbit`` / 8). A swarm round can only be as short as its payload at that rate: where p2p both ways is
below TCP both ways, the streams, not the link, set the pace. Every namespace and process it made is
removed on exit, also when interrupted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.netns_links import ShapedLan, prepare_benchmark  # noqa: E402

CASES = ("tcp_one_way", "tcp_both_ways", "p2p_one_way", "p2p_both_ways")
TCP_PORT = 5601


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--hosts", type=int, default=4, help="hosts taking part (default 4; at least 2)")
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate in each direction (default 100)")
    ap.add_argument("--mb", type=float, default=20.0, help="MB each taker takes per case (default 20)")
    ap.add_argument("--streams", default="1,4", help="comma-separated parallel streams for p2p (default 1,4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per case per line")
    ap.add_argument("--role", help=argparse.SUPPRESS)  # inside a namespace: host<i>
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--addresses", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peers", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.streams = [int(k) for k in args.streams.split(",")]
    if args.mbit <= 0 or args.mb <= 0 or args.repeats < 1 or min(args.streams) < 1 or args.hosts < 2:
        ap.error("--mbit and --mb must be > 0, --repeats and --streams >= 1, --hosts >= 2")
    return args


def schedule(args) -> list[tuple[str, int]]:
    """(case, streams) in the order both hosts run them."""
    many = ("_all_to_all",) if args.hosts > 2 else ()
    plan = [(f"tcp{c}", 1) for c in ("_one_way", "_both_ways", *many)]
    plan += [(f"p2p{c}", k) for k in args.streams for c in ("_one_way", "_both_ways", *many)]
    return [step for step in plan for _ in range(args.repeats)]


def slot_s(args) -> float:
    """Each case's slot: three times its bytes' time on the link, and two seconds."""
    return 3 * args.mb * 8 / args.mbit + 2.0


def takers(case: str, n: int) -> dict[int, list[int]]:
    """Who takes from whom in a case: {taker: [sources]}."""
    if case.endswith("one_way"):
        return {1: [0]}
    if case.endswith("both_ways"):
        return {0: [1], 1: [0]}
    return {i: [j for j in range(n) if j != i] for i in range(n)}


def host(args) -> None:
    """One host: serve, then take its share of every case at its slot; one JSON line per take."""
    import socket
    import threading

    import torch

    from swarm.net.dht_node import start_dht
    from swarm.net.hivemind_transport import HivemindTransport
    from swarm.net.timing import Timing

    d, me, addresses = Path(args.dir), int(args.role.removeprefix("host")), args.addresses.split(",")
    nbytes = int(args.mb * 1e6)
    listener = socket.create_server((addresses[me], TCP_PORT))
    shares = {1, args.hosts - 1}  # a taker takes from one source, or from every other host

    def send_tcp() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                size = int.from_bytes(conn.recv(8), "big")
                conn.sendall(bytes(size))

    threading.Thread(target=send_tcp, daemon=True).start()
    dht = start_dht([args.initial_peers], host=addresses[me])
    timing = Timing(
        matchmaking_s=3, round_s=60, download_s=60, heartbeat_s=5, request_s=2, final_agreement_s=5
    )
    transport = HivemindTransport(dht, timing, max_copy_bytes=2 * nbytes)
    servers = []
    for k in args.streams:
        for share in shares:
            server = transport.open_server(f"rate{k}x{share}")
            server.serve([torch.ones(nbytes // 2 // (k * share), dtype=torch.float16)], {"share": share})
            servers.append(server)
    (d / f"host{me}.id").write_text(dht.peer_id.to_base58())
    ids = {}
    for i in range(args.hosts):
        while not (d / f"host{i}.id").exists():
            time.sleep(0.1)
        ids[i] = (d / f"host{i}.id").read_text()

    def take_one(source: int, case: str, k: int, share: int) -> int:
        if case.startswith("tcp"):
            got = 0
            with socket.create_connection((addresses[source], TCP_PORT), timeout=60) as conn:
                conn.sendall((nbytes // share).to_bytes(8, "big"))
                while chunk := conn.recv(1 << 20):
                    got += len(chunk)
            return got
        served = transport.fetch(ids[source], f"rate{k}x{share}", timeout=60)
        return sum(t.numel() * t.element_size() for t in served.tensors) if served else 0

    for i, (case, k) in enumerate(schedule(args)):
        time.sleep(max(0.0, args.start + i * slot_s(args) - time.time()))
        sources = takers(case, args.hosts).get(me)
        if not sources:
            continue  # only sends in this case
        t0, jobs = time.monotonic(), [(src, case, k, len(sources)) for src in sources for _ in range(k)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = sum(pool.map(lambda job: take_one(*job), jobs))
        print(json.dumps({"case": case, "streams": k, "bytes": got, "s": time.monotonic() - t0}), flush=True)
    transport.close_groups(servers)  # each averager removes its socket (a killed one would leave it)
    dht.shutdown()


def run(args) -> list[dict]:
    from benchmarks.wan import Processes
    from peers.demo import wait_for_maddr

    d = Path(f"/tmp/stream_rate_{time.strftime('%H%M%S')}")
    d.mkdir(parents=True)
    procs, me = Processes(), [sys.executable, str(Path(__file__).resolve())]
    common = ["--hosts", str(args.hosts), "--mbit", str(args.mbit), "--mb", str(args.mb),
              "--streams", ",".join(map(str, args.streams)), "--repeats", str(args.repeats), "--dir", str(d)]  # fmt: skip
    n = args.hosts
    with ShapedLan(n + 1, args.mbit) as lan:
        try:
            boot = [sys.executable, "-m", "bootstrap.main", "--host", lan.address(n)]
            maddr = wait_for_maddr(
                d / "bootstrap.log", procs.start(lan.command(n, boot), d / "bootstrap.log")
            )
            start = time.time() + 20 + 5 * n  # every host up and serving by then
            addresses = ",".join(lan.address(i) for i in range(n))
            for i in range(n):
                argv = [*me, *common, "--role", f"host{i}", "--addresses", addresses, "--initial-peers", maddr,
                        "--start", str(start)]  # fmt: skip
                procs.start(lan.command(i, argv), d / f"host{i}.log")
            end = start + len(schedule(args)) * slot_s(args) + 30
            while time.time() < end and any(p.poll() is None for p in procs.procs[1:]):
                time.sleep(0.5)
        finally:
            procs.stop()
    takes = [
        json.loads(line)
        for i in range(n)
        for line in (d / f"host{i}.log").read_text().splitlines()
        if line.startswith('{"case"')
    ]
    rows, link = [], args.mbit * 1e6 / 8
    for case, k in dict.fromkeys(schedule(args)):
        mine = [t for t in takes if (t["case"], t["streams"]) == (case, k)]
        rates = [t["bytes"] / t["s"] for t in mine if t["bytes"] >= args.mb * 1e6 * 0.99]
        slowest = min(rates) if rates else None
        rows.append({
            "case": case, "streams": k, "takes": len(mine), "complete": len(rates),
            "MBps_median": round(statistics.median(rates) / 1e6, 2) if rates else None,
            "MBps_slowest": round(slowest / 1e6, 2) if rates else None,
            "of_link": round(statistics.median(rates) / link, 3) if rates else None,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        host(args)
        return 0
    why = prepare_benchmark()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rows = run(args)
    for r in rows:
        if args.json:
            print(json.dumps({"mbit": args.mbit, "mb": args.mb, **r}))
        else:
            print(f"{r['case']:<14} streams {r['streams']}: {r['MBps_median']} MB/s median, "
                  f"slowest {r['MBps_slowest']}, {r['of_link']} of the link ({r['complete']}/{r['takes']} whole)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
