"""Issue 13's averaging attacks, re-run with real processes: a rogue member that holds the swarm key.

    python benchmarks/attacks.py [--attacks none negated scaled nan huge weight] [--rules mean centered_clip centered_trim]
                                 [--minutes 1.5] [--set sync.sync_every_s=15] [--json]

For each rule (``sync.aggregation``) and attack: a keyed bootstrap, two honest ``swarm-peer``s and one rogue
peer on 127.0.0.1 with the demo config, all stopping at the same time. The rogue is the real peer with one
change, made in its own process only (``--rogue KIND``): what it sends to the dense group each round.
Relative to ``a``, the last dense average it got back, and ``x``, its own weights now:

    none     x                    (an honest third member: the control)
    negated  a - (x - a)          (its update, negated)
    scaled   a + 3 (x - a)        (its update, 3x)
    nan      NaN everywhere
    huge     1e38 everywhere
    weight   x, stating weight 1e7 to hivemind (and the largest weight our round info allows)

Printed per run: the honest peers' final validation loss (after their last round), how many dense rounds
they applied, and the rule and attack. The honest peers run unmodified code; a rule holds an attack when
their loss stays near the control's and rounds keep applying. Every process is stopped by PID and checked.

Poisoned expert copies (``--attacks copy_negated copy_zero copy_x100``, rule as given): the rogue holds 4 of
the 16 experts, trains them honestly, and serves them negated, zeroed or x100 to every downloader. Halfway
through, a fourth (honest) peer joins and catches up. Printed: how many of the rogue's copies the honest
peers refused, whether any honest peer or the joiner ended holding a poisoned copy of the rogue's experts
(a copy that points away from the rogue's own weights, or whose norm is off by more than 2x), the
joiner's catch-up line and its first validation loss next to the honest peers' latest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = ("none", "negated", "scaled", "nan", "huge", "weight")
COPY_ATTACKS = {"copy_negated": -1.0, "copy_zero": 0.0, "copy_x100": 100.0}  # what the served copies are x


def _poison(kind: str, x, a):
    import torch

    if kind == "negated":
        return a - (x - a)
    if kind == "scaled":
        return a + 3 * (x - a)
    if kind == "nan":
        return torch.full_like(x, float("nan"))
    if kind == "huge":
        return torch.full_like(x, 1e38)
    return x


def run_rogue(kind: str, peer_args: list[str]) -> int:
    """The peer's own main, with the dense payload (or the stated weight, or its served copies) replaced."""
    import swarm.net.swarm_sync as swarm_sync
    from peers.main import main
    from swarm.net.expert_server import ExpertServer
    from swarm.net.serving_averager import ServingAverager
    from swarm.train.process_exit import exit_process

    if kind in COPY_ATTACKS:
        factor, honest_update = COPY_ATTACKS[kind], ExpertServer.update

        def poisoned(self, items, step, final):
            return honest_update(
                self, {i: [factor * t.float() for t in ts] for i, ts in items.items()}, step, final
            )

        ExpertServer.update = poisoned
        return exit_process(main(peer_args))

    honest_round, agreed = swarm_sync.run_round, {}

    def rogue_round(plan, ctx, view):
        base = agreed.get("dense", plan.dense)
        dense = [_poison(kind, x, a) for x, a in zip(plan.dense, base, strict=True)]
        if kind == "weight":
            plan = dataclasses.replace(plan, weights={k: 100.0 for k in plan.weights})
        result = honest_round(dataclasses.replace(plan, dense=dense), ctx, view)
        if result.dense is not None:
            agreed["dense"] = [t.clone() for t in result.dense[1]]
        return result

    swarm_sync.run_round = rogue_round
    if kind == "weight":
        honest_step = ServingAverager.step
        ServingAverager.step = lambda self, *a, **k: honest_step(self, *a, **{**k, "weight": 1e7})
    return exit_process(main(peer_args))


def _wait_maddr(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    from peers.demo import wait_for_maddr

    return wait_for_maddr(log, proc, timeout)


def run_scenario(rule: str, attack: str, minutes: float, work: Path, extra: tuple[str, ...] = ()) -> dict:
    from swarm.config import load_config

    py, env = sys.executable, {**os.environ, "PYTHONUNBUFFERED": "1"}
    cfg = load_config(str(ROOT / "configs/demo.yaml"))
    subprocess.run([py, "-m", "swarm.data.cli", "stdlib", "--vocab-size", str(cfg.data.stdlib_vocab_size)],
                   cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip
    run = work / f"{rule}-{attack}"
    run.mkdir(parents=True)
    key = run / "swarm.key"
    run_id = f"atk-{rule.replace('_', '')}-{attack}-{os.getpid()}"
    sets = ["--set", f"run_id={run_id}", "--set", f"sync.aggregation={rule}", "--set", "train.threads=1"]
    sets += [a for kv in extra for a in ("--set", kv)]
    boot_log = open(run / "bootstrap.log", "w")
    procs = [subprocess.Popen([py, "-m", "bootstrap.main", "--new-swarm", "--swarm-key", str(key)], cwd=ROOT,
                              env=env, stdout=boot_log, stderr=subprocess.STDOUT, start_new_session=True)]  # fmt: skip
    try:
        maddr = _wait_maddr(run / "bootstrap.log", procs[0])
        stop_at = time.time() + 20 + 60 * minutes
        for i in range(3):
            args = ["--config", str(ROOT / "configs/demo.yaml"), "--initial-peers", maddr, "--swarm-key",
                    str(key), "--run-dir", str(run / f"peer{i}"), "--stop-at", str(stop_at), "--no-progress",
                    *sets]  # fmt: skip
            cmd = (
                [py, __file__, "--rogue", attack, "--", *args] if i == 2 else [py, "-m", "peers.main", *args]
            )
            with open(run / f"peer{i}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        bound = stop_at - time.time() + cfg.sync.round_timeout_s + 90
        codes = [p.wait(timeout=max(1.0, bound)) for p in procs[1:]]
    finally:
        _stop(procs)
    honest = [_summary(run, i) for i in range(2)]
    return {
        "rule": rule,
        "attack": attack,
        "honest_val_loss": [h["val_loss"] for h in honest],
        "honest_dense_rounds": [h["dense_rounds"] for h in honest],
        "dense_group_of_3": [h["groups_of_3"] for h in honest],
        "exit_codes": codes,
    }


def run_copy_scenario(
    rule: str, attack: str, minutes: float, work: Path, extra: tuple[str, ...] = ()
) -> dict:
    """Two honest peers and a rogue serving poisoned copies of its experts; an honest joiner halfway."""
    py, env = sys.executable, {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = work / f"{rule}-{attack}"
    run.mkdir(parents=True)
    key, run_id = run / "swarm.key", f"atk-{rule.replace('_', '')}-{attack.replace('_', '')}-{os.getpid()}"
    sets = ["--set", f"run_id={run_id}", "--set", f"sync.aggregation={rule}", "--set", "train.threads=1"]
    sets += [a for kv in extra for a in ("--set", kv)]
    boot_log = open(run / "bootstrap.log", "w")
    procs = [subprocess.Popen([py, "-m", "bootstrap.main", "--new-swarm", "--swarm-key", str(key)], cwd=ROOT,
                              env=env, stdout=boot_log, stderr=subprocess.STDOUT, start_new_session=True)]  # fmt: skip

    def start(i: int, stop_at: float) -> None:
        args = ["--config", str(ROOT / "configs/demo.yaml"), "--initial-peers", maddr, "--swarm-key", str(key),
                "--run-dir", str(run / f"peer{i}"), "--stop-at", str(stop_at), "--no-progress", *sets]  # fmt: skip
        cmd = [py, __file__, "--rogue", attack, "--", *args] if i == 2 else [py, "-m", "peers.main", *args]
        with open(run / f"peer{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip

    try:
        maddr = _wait_maddr(run / "bootstrap.log", procs[0])
        t0 = time.time()
        stop_at = t0 + 20 + 60 * minutes
        for i in range(3):
            start(i, stop_at)
        time.sleep(max(0.0, t0 + 20 + 30 * minutes - time.time()))
        start(3, stop_at)  # the joiner
        bound = stop_at - time.time() + 120
        codes = [p.wait(timeout=max(1.0, bound)) for p in procs[1:]]
    finally:
        _stop(procs)
    return {"rule": rule, "attack": attack, **_copies_summary(run), "exit_codes": codes}


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _copies_summary(run: Path) -> dict:
    """Refusals of the rogue's copies, poisoned copies held at the end, and what the joiner took."""
    import torch

    from swarm.sync.copy_prints import copy_doubt
    from swarm.train.checkpoint import latest_checkpoint, load_checkpoint

    ckpts = [load_checkpoint(latest_checkpoint(run / f"peer{i}" / "checkpoints")) for i in range(4)]
    rogue_experts = ckpts[2].state["local_experts"]

    def copy(i: int, e: int) -> list[torch.Tensor]:
        return [t[e] for k, t in sorted(ckpts[i].model.items()) if ".experts." in k]

    poisoned = {i: [e for e in rogue_experts if copy_doubt(copy(i, e), copy(2, e))] for i in (0, 1, 3)}
    refused = 0  # refusals of the rogue's copies, in rounds and after the last one
    for i in (0, 1, 3):
        for line in (run / f"peer{i}" / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            whys = (rec.get("rejected") or []) + (rec.get("download_failures") or [])
            refused += sum(
                1
                for why in whys
                if why.startswith(tuple(f"expert{e}{c}" for e in rogue_experts for c in " :["))
            )
    log = (run / "peer3.log").read_text()
    caught = next((ln for ln in log.splitlines() if ln.startswith("caught up with the swarm")), "")
    metrics = [json.loads(ln) for ln in (run / "peer3" / "metrics.jsonl").read_text().splitlines()]
    joined = next((r for r in metrics if "val_loss" in r), {})
    honest_then = []  # the joiner came halfway through: the honest peers' validation loss nearest to then
    for i in (0, 1):
        vals = [json.loads(ln) for ln in (run / f"peer{i}" / "metrics.jsonl").read_text().splitlines()]
        vals = [(r["step"], r["val_loss"]) for r in vals if "val_loss" in r]
        half = max(s for s, _ in vals) / 2 if vals else 0
        honest_then.append(min(vals, key=lambda sv: abs(sv[0] - half))[1] if vals else None)
    return {
        "rogue_experts": rogue_experts,
        "refused_copies": refused,
        "poisoned_copies_held": poisoned,
        "joiner_caught_up": caught,
        "joiner_first_val_loss": joined.get("val_loss"),
        "honest_val_loss_at_mid_run": honest_then,
    }


def _summary(run: Path, i: int) -> dict:
    """An honest peer's validation loss after its last round (the summary line it prints) and its rounds."""
    val, dense, of3 = None, 0, 0
    for line in (run / f"peer{i}.log").read_text().splitlines():
        if line.startswith("{") and "final_val_loss" in line:
            val = json.loads(line)["final_val_loss"]
    for line in (run / f"peer{i}" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "dense" in (rec.get("applied_groups") or []):
            dense += 1
            of3 += rec.get("dense_group") == 3
    return {"val_loss": val, "dense_rounds": dense, "groups_of_3": of3}


def main() -> int:
    if "--rogue" in sys.argv:
        i = sys.argv.index("--rogue")
        return run_rogue(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1 :])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=[*ATTACKS, *COPY_ATTACKS])
    ap.add_argument("--rules", nargs="+", default=["mean", "centered_clip", "centered_trim"])
    ap.add_argument("--minutes", type=float, default=1.5)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides, every peer"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-attacks-") as tmp:
        for rule in args.rules:
            for attack in args.attacks:
                scenario = run_copy_scenario if attack in COPY_ATTACKS else run_scenario
                row = scenario(rule, attack, args.minutes, Path(tmp), tuple(args.set))
                row["set"] = args.set
                if args.json or attack in COPY_ATTACKS:
                    print(json.dumps(row), flush=True)
                else:
                    losses = ", ".join(
                        f"{v:.3f}" if v is not None else "none" for v in row["honest_val_loss"]
                    )
                    print(f"{rule:>13} {attack:>8}: honest val loss {losses}; dense rounds applied "
                          f"{row['honest_dense_rounds']} (with all 3: {row['dense_group_of_3']}); "
                          f"exit codes {row['exit_codes']}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
