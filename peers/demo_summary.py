"""The summary ``swarm-demo`` prints at the end: per-peer rounds and loss, expert coverage, how far the
replicas agree after the last round, and bytes per round measured against the design's prediction."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.sync.codecs import CODECS, Codec
from swarm.sync.round_traffic import ModelBytes, RoundTraffic
from swarm.train.round_record import RoundRecord


def read_jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def summarize(
    run_dirs: list[Path],
    n_experts: int,
    codec: Codec = CODECS["fp32"],
    dense_codec: Codec | None = None,
    refresh_every: int = 1,
    embeddings_every: int = 1,
) -> dict:
    """Per-peer validation loss, expert coverage, rounds completed and bytes per round (predicted for the
    swarm's ``codec``, ``dense_codec`` for the dense all-reduce (default ``codec``), the copies moving
    every ``refresh_every``-th round and all the dense weights every ``embeddings_every``-th: the mean over
    rounds, as measured)."""
    peers, holders = [], {e: 0 for e in range(n_experts)}
    for i, d in enumerate(run_dirs):
        recs = read_jsonl(d / "metrics.jsonl")
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        rounds = [RoundRecord.from_dict(r) for r in recs if RoundRecord.is_round(r)]
        rounds = [r for r in rounds if r.started]
        ok = [r for r in rounds if r.clean]
        # everything our p2pd moved from the first ordinary round to the last, per round: what we serve to
        # others after our own round ended (with groups met before the slot, rounds are short) counts too
        totals = [r.wire_total for r in rounds if not r.last and r.wire_total is not None]
        per_round = [(totals[-1] - totals[0]) / (len(totals) - 1)] if len(totals) >= 2 else []
        state = {}
        ckpts = sorted((d / "checkpoints").glob("step_*/state.json"))
        if ckpts:
            state = json.loads(ckpts[-1].read_text())
        experts = state.get("local_experts", [])
        for e in experts:
            holders[e] += 1
        peers.append(
            {
                "peer": i,
                "experts": experts,
                "steps": state.get("step"),
                "val_loss_first": val[0] if val else None,
                "val_loss_last": val[-1] if val else None,
                "rounds": len(rounds),
                "rounds_clean": len(ok),
                "bytes_per_round": int(sum(per_round) / len(per_round)) if per_round else 0,
            }
        )
    covered = sum(1 for c in holders.values() if c > 0)
    return {
        "peers": peers,
        "experts_covered": covered,
        "n_experts": n_experts,
        "holders": holders,
        "replicas": replica_spread(run_dirs, [p["experts"] for p in peers]),
        "refresh_every": refresh_every,
        "embeddings_every": embeddings_every,
        "predicted_bytes_per_round": predicted_bytes(
            run_dirs,
            [p["experts"] for p in peers],
            codec,
            dense_codec or codec,
            refresh_every,
            embeddings_every,
        ),
    }


def predicted_bytes(
    run_dirs: list[Path],
    experts: list[list[int]],
    codec: Codec,
    dense_codec: Codec,
    refresh_every: int = 1,
    embeddings_every: int = 1,
) -> int | None:
    """What the design predicts a peer moves per round, the mean over rounds of which every
    ``refresh_every``-th moves the copies and every ``embeddings_every``-th all the dense weights
    (``swarm.sync.round_traffic``), for the tensors of the first peer's last checkpoint and the experts
    each peer trained."""
    from safetensors import safe_open

    from swarm.train.checkpoint import latest_checkpoint

    path = latest_checkpoint(run_dirs[0] / "checkpoints")
    if path is None:
        return None
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    sizes = ModelBytes.of(shapes, codec, dense_codec)
    n_experts = next(shape[0] for key, shape in shapes.items() if ".experts." in key)
    return int(RoundTraffic.of(sizes, experts, n_experts).mean_per_peer(refresh_every, embeddings_every))


def replica_spread(run_dirs: list[Path], experts: list[list[int]]) -> dict:
    """Largest absolute difference, across peers' final checkpoints, of the dense weights; of each expert
    among its holders; and of every peer's copy of a non-local expert against a holder's."""
    from safetensors.torch import load_file

    from swarm.train.checkpoint import latest_checkpoint

    models = []
    for d in run_dirs:
        path = latest_checkpoint(d / "checkpoints")
        models.append(load_file(str(path / "model.safetensors")) if path else None)
    if any(m is None for m in models) or len(models) < 2:
        return {}
    spread = {"dense": 0.0, "expert_replicas": 0.0, "non_local_copies": 0.0}
    for key, ref in models[0].items():
        if ".experts." not in key:
            spread["dense"] = max(spread["dense"], *((m[key] - ref).abs().max().item() for m in models[1:]))
            continue
        for e in range(ref.shape[0]):
            holders = [i for i, ex in enumerate(experts) if e in ex]
            if not holders:
                continue
            base = models[holders[0]][key][e]
            for i, m in enumerate(models):
                diff = (m[key][e] - base).abs().max().item()
                slot = "expert_replicas" if i in holders else "non_local_copies"
                spread[slot] = max(spread[slot], diff)
    return spread


def print_summary(s: dict, formed_s: float | None) -> None:
    print("\n=== swarm summary ===")
    if formed_s is not None:
        print(f"swarm formed in {formed_s:.1f} s (every peer joined)")
    for p in s["peers"]:
        a, b = p["val_loss_first"], p["val_loss_last"]
        loss = f"{a:.3f} -> {b:.3f}" if a is not None and b is not None else "n/a"
        print(
            f"peer {p['peer']}: experts {p['experts']}, {p['steps']} steps, val loss {loss}, "
            f"rounds {p['rounds']} ({p['rounds_clean']} clean), {p['bytes_per_round'] / 1e6:.2f} MB per round (measured)"
        )
    if s.get("replicas"):
        r = s["replicas"]
        print(
            f"replica agreement after the last round (max |difference|): dense {r['dense']:.2e}, "
            f"expert replicas {r['expert_replicas']:.2e}, non-local copies {r['non_local_copies']:.2e} (fp16 wire)"
        )
    pred = s.get("predicted_bytes_per_round")
    measured = [p["bytes_per_round"] for p in s["peers"] if p["bytes_per_round"]]
    if pred and measured:
        mean = sum(measured) / len(measured)
        every = s.get("refresh_every", 1)
        spacing = [f"copies every {every} rounds"] if every > 1 else []
        if s.get("embeddings_every", 1) > 1:
            spacing.append(f"all dense weights every {s['embeddings_every']} rounds, the core ones between")
        copies = f" ({'; '.join(spacing)})" if spacing else ""
        print(
            f"bytes per peer per round: measured {mean / 1e6:.2f} MB (I/O of each peer's p2pd from its first "
            f"ordinary round to its last, mean over peers), design predicts {pred / 1e6:.2f} MB{copies}: "
            f"ratio {mean / pred:.2f}"
        )
    missing = [e for e, c in s["holders"].items() if c == 0]
    print(
        f"experts covered: {s['experts_covered']}/{s['n_experts']}"
        + (f" (uncovered: {missing})" if missing else "")
    )
