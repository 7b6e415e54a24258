"""Peers that come, go and differ, with real processes on 127.0.0.1: a late joiner catches up, an orphaned
expert is re-claimed while a slow peer and a fast one both keep training."""

import math
import signal
import time

import pytest
import torch

from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import reap, round_records, start_peer, swarm_peer_args, wait_until

pytestmark = pytest.mark.timeout(300)


def _metrics(run):
    path = run / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def _steps(run):
    return [r for r in _metrics(run) if "loss" in r]


def test_orphan_is_reclaimed_while_a_slow_and_a_fast_peer_train(tiny_config, tmp_path, bootstrap_peer):
    """Peer 1 alone holds experts 4-7 and leaves; peers 0 and 2 both hold 0-3, so exactly one of them takes
    an orphan. Peer 2 does six times the work per step: neither waits for the other."""
    runs = [tmp_path / f"p{i}" for i in range(3)]
    own = {0: "[0,1,2,3]", 1: "[4,5,6,7]", 2: "[0,1,2,3]"}

    def start(i, *extra):
        extra = ["--set", "experts.per_peer=null", "--set", f"experts.local={own[i]}", *extra]
        extra += ["--set", "sync.orphan_grace_s=4"]
        return start_peer(
            swarm_peer_args(tiny_config, bootstrap_peer, runs[i], *extra), tmp_path / f"p{i}.err"
        )

    procs = [start(1, "--max-minutes", "2")]
    try:
        wait_until(lambda: len(_steps(runs[1])) > 0, 90, "peer 1 training")  # its experts are in the DHT
        stop_at = str(time.time() + 36)  # peers 0 and 2 meet for a last round at the same time
        procs += [
            start(0, "--stop-at", stop_at),
            start(2, "--stop-at", stop_at, "--set", "train.grad_accum=6"),
        ]
        wait_until(lambda: all(len(_steps(r)) > 0 for r in runs), 90, "every peer training")
        time.sleep(4)  # two heartbeat periods: every peer has seen the others' experts
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
        ckpts = {j: load_checkpoint(latest_checkpoint(runs[j] / "checkpoints")) for j in (0, 2)}
        assert ckpts[i].state["local_experts"] == new
        assert all(torch.isfinite(t).all() for c in ckpts.values() for t in c.model.values())
        # it took the orphan after the grace period, and trained it afterwards
        after = [r for r in _steps(runs[i]) if r["step"] > event["step"]]
        assert len(after) > 5 and all(math.isfinite(r["loss"]) for r in after)
        assert time.time() - left > 4
        # the fast peer did not wait for the slow one (had it, their step counts would be about equal), and
        # both met for the last round. Per-step overheads (logging, evaluation, rounds) shrink the 6x work
        # ratio to 2-3x in steps, less on a loaded machine (1.9x once)
        fast, slow = (_steps(runs[j])[-1]["step"] for j in (0, 2))
        assert fast > 1.5 * slow > 0, (fast, slow)
        for j in (0, 2):
            rounds = round_records(runs[j])
            assert all(r.sync_seconds <= 30 + 5 for r in rounds if not r.last)
            assert rounds[-1].last and rounds[-1].final_unsettled == [], rounds[-1]
        # they end with the same dense weights: averaged together, or (where the last round failed on one
        # side) one adopted the other's copy in the final agreement, fp16 on the wire
        adopted = any("dense" in round_records(runs[j])[-1].final_adopted for j in (0, 2))
        a, b = ckpts[0].model, ckpts[2].model
        for k in a:
            if ".experts." not in k:
                tol = 2e-3 * b[k].abs().max().item() if adopted else 1e-5
                assert torch.allclose(a[k], b[k], atol=tol, rtol=0), k
    finally:
        reap(procs)
