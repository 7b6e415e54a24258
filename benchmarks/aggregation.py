"""What the robust rules cost a reducer, next to hivemind's plain mean, on one machine side by side.

    python benchmarks/aggregation.py [--config configs/demo.yaml] [--members 2 3 4] [--repeats 5] [--json]

Each of a group's n members reduces a 1/n share of the group's vector, part by part (hivemind's parts of
512 KiB), in ``RuledPartReducer``, on one thread of its averager's process, all members at once. This times
one member's share of the dense group (the config's dense weights: the largest group a peer runs) for
``mean``, ``centered_clip`` and ``centered_trim``, in the same process and interleaved, and prints the seconds, the extra
time per MB reduced, and the extra time next to the time the all-reduce's bytes take on a link of
``--mbit`` (2 (n-1)/n of the vector per member). Bytes: nothing extra travels (the rule runs where hivemind's sum ran, on the
parts it receives anyway), so the bytes ratio is 1 by construction; ``tests/test_ruled_allreduce.py`` runs
the rule inside real all-reduces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from swarm.config import load_config
from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors
from swarm.net.ruled_allreduce import RuledPartReducer
from swarm.sync.robust_mean import aggregation_rule


def reduce_seconds(parts: list[torch.Tensor], members: int, rule) -> float:
    """Wall time for one reducer to take every member's copy of ``parts`` and return the aggregates."""
    noisy = [[p + 0.01 * m for p in parts] for m in range(members)]

    async def run() -> None:
        reducer = RuledPartReducer([p.shape for p in parts], members, rule)  # its futures: this loop's

        async def sender(m: int) -> None:
            for i, p in enumerate(noisy[m]):
                await reducer.accumulate_part(m, i, p)

        await asyncio.gather(*(sender(m) for m in range(members)))

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--members", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--json", action="store_true", help="one JSON object per group size")
    args = ap.parse_args()
    torch.set_num_threads(1)  # an averager's process reduces on one thread (as_hivemind_child)
    cfg = load_config(args.config)
    vector = torch.cat(
        [t.detach().float().reshape(-1) for t in dense_tensors(MoETransformer(cfg.model, [0]))]
    )
    rules = {name: aggregation_rule(name) for name in ("mean", "centered_clip", "centered_trim")}
    for n in args.members:
        parts = list(vector[: vector.numel() // n].split(DEFAULT_PART_SIZE_BYTES // 4))  # one member's share
        times = {name: [] for name in rules}
        for _ in range(args.repeats):  # interleaved: a slow phase of a shared machine hits all alike
            for name, rule in rules.items():
                times[name].append(reduce_seconds(parts, n, rule))
        seconds = {k: statistics.median(v) for k, v in times.items()}
        # a butterfly all-reduce moves 2 (n-1)/n of the vector per member
        link_s = 2 * (n - 1) / n * vector.numel() * 4 * 8 / (args.mbit * 1e6)
        mb = vector.numel() // n * 4 / 1e6
        row = {"members": n, "values": vector.numel(), "bytes_ratio": 1.0}
        for name, sec in seconds.items():
            row[f"{name}_s"] = round(sec, 4)
            if name != "mean":
                row[f"{name}_extra_s_per_mb"] = round((sec - seconds["mean"]) / mb, 5)
                row[f"{name}_extra_vs_link"] = round((sec - seconds["mean"]) / link_s, 4)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        extras = "; ".join(
            f"{name} {seconds[name]:.3f} s (extra {row[f'{name}_extra_s_per_mb'] * 1e3:.2f} ms/MB reduced, "
            f"{row[f'{name}_extra_vs_link']:.1%} of the all-reduce's time on a {args.mbit:g} Mbit/s link)"
            for name in rules
            if name != "mean"
        )
        print(
            f"{n} members, a share of {row['values'] // n:,} values: mean {seconds['mean']:.3f} s; {extras}",
            flush=True,
        )


if __name__ == "__main__":
    main()
