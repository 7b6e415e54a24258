"""A 2-peer round on one device: how long it takes, and how much of it is device <-> host copying.

What is measured
    Two hivemind DHT nodes and two dense ``HivemindGroup``s in this process (127.0.0.1 only, the project's
    safe defaults), and two models on the device (``swarm.model.MoETransformer``, experts 0-3 local, frozen
    bf16, different weights: seeds 0 and 1). One round, done the way a peer does it (hivemind cannot average
    CUDA tensors: NOTES.md):

    1. snapshot  ``swarm.net.expert_tensors.snapshot(dense_tensors(model))``: fp32 copies on the host
    2. average   ``HivemindGroup.start`` on both peers, then ``outcome``: the all-reduce in hivemind's own
                 processes (includes its minimum matchmaking time, ``--matchmaking-s``)
    3. apply     ``swarm.sync.OuterStep(alpha=1).apply(params, snapshot, average)`` on views of the
                 model's dense weights (``dense_tensors``): theta += a - s, moving to the device what it must

    Peer A's times are the round's: ``round_s = snapshot_s + average_s + apply_s``; ``copy_s`` is its
    device -> host snapshot plus a host -> device transfer of one dense-sized set of fp32 tensors (timed on
    its own: what ``apply`` moves), and ``copy_fraction = copy_s / round_s``. For comparison it also times a
    bare non-blocking copy of the same tensors into pinned buffers (CUDA only): the least a snapshot can
    cost. The result is checked: after the round both peers hold the mean of their snapshots.

Usage::

    python benchmarks/gpu_round.py                     # CUDA, spes-1b shape (1 GB of dense weights)
    python benchmarks/gpu_round.py --device cpu --tiny --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.config import load_config  # noqa: E402
from swarm.model import MoETransformer  # noqa: E402
from swarm.net.dht_node import start_dht, visible_maddrs  # noqa: E402
from swarm.net.expert_tensors import dense_tensors, snapshot  # noqa: E402
from swarm.net.hivemind_group import HivemindGroup  # noqa: E402
from swarm.sync.apply_average import OuterStep  # noqa: E402

TINY = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.expert_hidden=64",
]


def timed(fn, device: torch.device):
    """(result, seconds) with the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def measure_round(cfg, device: torch.device, matchmaking_s: float, timeout_s: float) -> dict:
    """Run one 2-peer dense round (module docstring) and return its record."""
    models = []
    for seed in (0, 1):
        m = MoETransformer(cfg.model, list(range(min(4, cfg.model.n_experts))), "bfloat16")
        m.init_weights(seed)
        models.append(m)
    like = snapshot(dense_tensors(models[0]))
    dense_bytes = sum(t.numel() * 4 for t in like)
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").exists() else None
    if shm is not None and shm < 3 * dense_bytes:  # each averager shares its fp32 tensors through /dev/shm
        return {"error": f"needs ~{3 * dense_bytes / 1e9:.1f} GB free in /dev/shm, has {shm / 1e9:.1f} GB"}
    dhts, groups = [], []
    try:
        dhts.append(start_dht())
        dhts.append(start_dht(initial_peers=visible_maddrs(dhts[0])))
        for dht in dhts:
            groups.append(
                HivemindGroup(
                    dht,
                    "gpuround_dense",
                    like,
                    matchmaking_time=matchmaking_s,
                    allreduce_timeout=timeout_s,
                    # below the matchmaking time, as hivemind recommends (else it warns of rare deadlocks)
                    request_timeout=0.8 * matchmaking_s,
                )
            )
        for m in models:
            m.to(device)
        snaps, snap_s = zip(
            *(timed(lambda m=m: snapshot(dense_tensors(m)), device) for m in models), strict=True
        )
        t0 = time.perf_counter()
        controls = [
            g.start(s, {"peer": i}, matchmaking_s + timeout_s)
            for i, (g, s) in enumerate(zip(groups, snaps, strict=True))
        ]
        outcomes = [
            g.outcome(c, timeout=matchmaking_s + 2 * timeout_s) for g, c in zip(groups, controls, strict=True)
        ]
        average_s = time.perf_counter() - t0
        if not all(o.ok for o in outcomes):
            return {"error": "round failed: " + "; ".join(o.reason for o in outcomes if not o.ok)}
        # the host -> device transfer inside apply(), on its own: one dense-sized set of fp32 tensors
        _, h2d_s = timed(lambda: [t.to(device) for t in outcomes[0].tensors], device)
        apply_s = []
        for m, s, o in zip(models, snaps, outcomes, strict=True):
            params = dense_tensors(m)  # in-place views of the model's weights, as the peer applies them
            keys = [str(i) for i in range(len(params))]
            step = OuterStep(1.0)
            _, sec = timed(
                lambda step=step, params=params, keys=keys, s=s, o=o: step.apply(
                    dict(zip(keys, params, strict=True)),
                    dict(zip(keys, s, strict=True)),
                    dict(zip(keys, o.tensors, strict=True)),
                ),
                device,
            )
            apply_s.append(sec)
        expected = [(a + b) / 2 for a, b in zip(*snaps, strict=True)]
        after = [snapshot(dense_tensors(m)) for m in models]
        err = max(max((x - e).abs().max().item() for x, e in zip(a, expected, strict=True)) for a in after)
        pinned_s = None
        if device.type == "cuda":
            bufs = [torch.empty(t.shape, dtype=torch.float32, pin_memory=True) for t in like]
            _, pinned_s = timed(
                lambda: [
                    b.copy_(t.float(), non_blocking=True)
                    for b, t in zip(bufs, dense_tensors(models[0]), strict=True)
                ],
                device,
            )
        round_s = snap_s[0] + average_s + apply_s[0]
        copy_s = snap_s[0] + h2d_s
        return {
            "dense_tensors": len(like),
            "dense_bytes": dense_bytes,
            "matchmaking_s": matchmaking_s,
            "snapshot_s": snap_s[0],
            "average_s": average_s,
            "apply_s": apply_s[0],
            "h2d_s": h2d_s,
            "round_s": round_s,
            "copy_s": copy_s,
            "copy_fraction": copy_s / round_s,
            "pinned_d2h_s": pinned_s,
            "group_sizes": [len(o.members) for o in outcomes],
            "max_abs_error_vs_mean": err,
        }
    finally:
        # right after a round each averager still has DHT requests in flight; shut down at once, its DHT
        # process fails to read them and takes its whole grace period to stop (seen with 21 tensors)
        time.sleep(1.0)
        for g in groups:
            g.close()
        for dht in dhts:
            dht.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available, else skip")
    ap.add_argument("--config", default=str(ROOT / "configs" / "spes-1b.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (vocab 512, d_model 64, 2 layers)")
    ap.add_argument("--matchmaking-s", type=float, default=3.0, help="hivemind min matchmaking time (3)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="all-reduce timeout (120)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("gpu_round: skipped: no CUDA device (use --device cpu --tiny to run it on CPU)")
            return 0
        args.device = "cuda"
    cfg = load_config(args.config, (TINY if args.tiny else []) + list(args.set))
    rec = {"kind": "round", "device": args.device}
    rec |= measure_round(cfg, torch.device(args.device), args.matchmaking_s, args.timeout_s)
    if args.json:
        print(json.dumps(rec), flush=True)
    elif "error" in rec:
        print(f"2-peer round: ERROR {rec['error']}")
    else:
        print(
            f"2-peer round ({rec['dense_bytes'] / 1e6:.1f} MB of fp32 dense weights, groups {rec['group_sizes']}): "
            f"{rec['round_s']:.2f} s = snapshot {rec['snapshot_s']:.3f} s + average {rec['average_s']:.2f} s "
            f"(min matchmaking {rec['matchmaking_s']} s) + apply {rec['apply_s']:.3f} s; device<->host copies "
            f"{rec['copy_s']:.3f} s ({100 * rec['copy_fraction']:.1f}%); pinned device->host copy "
            + ("n/a" if rec["pinned_d2h_s"] is None else f"{rec['pinned_d2h_s']:.3f} s")
            + f"; max |result - mean| {rec['max_abs_error_vs_mean']:.1e}"
        )
    return 0 if "error" not in rec else 1


if __name__ == "__main__":
    sys.exit(main())
