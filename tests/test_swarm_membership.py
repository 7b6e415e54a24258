"""Peers that come, go and differ, with real processes on 127.0.0.1: a late joiner catches up, an orphaned
expert is re-claimed, and a slow peer and a fast one both keep training."""

import math
import signal
import time

import pytest
import torch

from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import SWARM_SETTINGS, reap, round_records, start_peer, wait_until

pytestmark = pytest.mark.timeout(300)


def _args(tiny_config, bootstrap_peer, run, *extra):
    return [
        "--config",
        str(tiny_config),
        "--initial-peers",
        bootstrap_peer,
        "--run-dir",
        str(run),
        "--max-steps",
        "100000",
        *SWARM_SETTINGS,
        *extra,
    ]


def _metrics(run):
    path = run / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def _steps(run):
    return [r for r in _metrics(run) if "loss" in r]


def test_late_joiner_catches_up(tiny_config, tmp_path, bootstrap_peer):
    runs = [tmp_path / f"p{i}" for i in range(3)]
    procs = [
        start_peer(
            _args(tiny_config, bootstrap_peer, runs[i], "--max-minutes", "1.0"), tmp_path / f"p{i}.err"
        )
        for i in range(2)
    ]
    late = None
    try:
        wait_until(lambda: all(len(round_records(r)) >= 2 for r in runs[:2]), 150, "two rounds on both")
        late = start_peer(
            _args(tiny_config, bootstrap_peer, runs[2], "--max-minutes", "0.3"), tmp_path / "p2.err"
        )
        for p in [*procs, late]:
            assert p.wait(timeout=200) == 0
        log = (tmp_path / "p2.err").read_text()
        assert "caught up with the swarm: dense fetched, 8/8 experts fetched" in log, log[-3000:]
        # the late peer's first evaluation (before its first step) already has the swarm's quality
        fresh = _metrics(runs[0])[0]["val_loss"]  # the shared initialisation, measured by peer 0 at step 0
        joined = _metrics(runs[2])[0]["val_loss"]
        trained = [r["val_loss"] for r in _metrics(runs[0]) if "val_loss" in r]
        assert joined < fresh - 0.3, (fresh, joined)
        assert joined < max(trained[len(trained) // 3 :]) + 0.05, (joined, trained)
        # and it averages with the others afterwards
        assert any(r["dense_group"] >= 2 and "dense" in r["applied_groups"] for r in round_records(runs[2]))
    finally:
        reap([*procs, late])


def test_orphaned_experts_are_reclaimed(tiny_config, tmp_path, bootstrap_peer):
    runs = [tmp_path / f"p{i}" for i in range(3)]
    own = {0: "[0,1,2,3]", 1: "[4,5,6,7]", 2: "[0,1,2,3]"}  # experts 4-7 live only on peer 1

    def start(i, minutes):
        extra = ["--set", "experts.per_peer=null", "--set", f"experts.local={own[i]}"]
        extra += ["--set", "sync.orphan_grace_s=4", "--max-minutes", str(minutes)]
        return start_peer(_args(tiny_config, bootstrap_peer, runs[i], *extra), tmp_path / f"p{i}.err")

    procs = [start(1, 2.0)]
    try:
        wait_until(lambda: len(_steps(runs[1])) > 0, 90, "peer 1 training")  # its experts are in the DHT
        procs += [start(0, 0.6), start(2, 0.6)]
        wait_until(lambda: all(len(round_records(r)) >= 1 for r in runs), 150, "a round on every peer")
        procs[0].send_signal(signal.SIGTERM)  # peer 1 leaves: experts 4-7 have no holder any more
        left = time.time()
        assert procs[0].wait(timeout=60) == 130  # interrupted: checkpoint written, heartbeat withdrawn
        for p in procs[1:]:
            assert p.wait(timeout=200) == 0
        switches = {
            i: [r for r in _metrics(runs[i]) if "experts_switched" in r] for i in (0, 2)
        }  # exactly one peer takes one orphan; then nobody's experts are all replicated any more
        assert sum(len(s) for s in switches.values()) == 1, switches
        (i, [event]) = next((i, s) for i, s in switches.items() if s)
        old, new = event["experts_switched"]["from"], event["experts_switched"]["to"]
        assert old == [0, 1, 2, 3] and len(set(new) - set(old)) == 1 and set(new) - set(old) <= {4, 5, 6, 7}
        ckpt = load_checkpoint(latest_checkpoint(runs[i] / "checkpoints"))
        assert ckpt.state["local_experts"] == new
        assert all(torch.isfinite(t).all() for t in ckpt.model.values())
        # it took the orphan after the grace period, and trained it afterwards
        after = [r for r in _steps(runs[i]) if r["step"] > event["step"]]
        assert len(after) > 20 and all(math.isfinite(r["loss"]) for r in after)
        assert time.time() - left > 4
    finally:
        reap(procs)


def test_slow_and_fast_peers_both_keep_training(tiny_config, tmp_path, bootstrap_peer):
    runs = [tmp_path / "fast", tmp_path / "slow"]
    stop_at = time.time() + 30
    common = ["--max-minutes", "5", "--stop-at", str(stop_at)]
    procs = [
        start_peer(_args(tiny_config, bootstrap_peer, runs[0], *common), tmp_path / "fast.err"),
        start_peer(
            _args(tiny_config, bootstrap_peer, runs[1], *common, "--set", "train.grad_accum=6"),
            tmp_path / "slow.err",
        ),
    ]
    try:
        for p in procs:
            assert p.wait(timeout=240) == 0
        fast, slow = (_steps(r)[-1]["step"] for r in runs)
        assert fast > 2 * slow > 0, (fast, slow)  # neither waited for the other
        for run in runs:
            rounds = round_records(run)
            assert all(r["sync_seconds"] <= 30 + 5 for r in rounds if not r.get("final"))
            assert rounds[-1].get("final") and rounds[-1]["dense_group"] == 2  # they meet at the end
            assert "dense" in rounds[-1]["applied_groups"]
        a, b = (load_checkpoint(latest_checkpoint(r / "checkpoints")).model for r in runs)
        for k in a:
            if ".experts." not in k:
                assert torch.allclose(a[k], b[k], atol=1e-5), k
    finally:
        reap(procs)
