"""A real swarm on 127.0.0.1: a bootstrap peer and three ``swarm-peer`` processes train and synchronise."""

import time

import pytest
import torch

from swarm.config import load_config
from swarm.net.round_memory import held_bytes
from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import (
    reap,
    round_records,
    run_peer,
    start_peer,
    swarm_peer_args,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)


def test_peers_cover_all_experts_average_a_late_joiner_catches_up_and_another_model_is_refused(
    tiny_config, tmp_path, bootstrap_peer
):
    runs = [tmp_path / f"p{i}" for i in range(4)]
    stop_at = str(time.time() + 50)  # a shared stop time: the peers meet for their last round together

    def start(i):
        args = swarm_peer_args(tiny_config, bootstrap_peer, runs[i], "--stop-at", stop_at, max_steps=100000)
        return start_peer(args, tmp_path / f"p{i}.err")

    procs = [start(i) for i in range(3)]
    try:
        wait_until(lambda: all(len(round_records(r)) >= 1 for r in runs[:3]), 90, "a round on every peer")
        procs.append(start(3))  # joins a swarm that has trained: it must catch up
        wait_until(lambda: "caught up" in (tmp_path / "p3.err").read_text(), 90, "the late peer caught up")
        # meanwhile a peer with another model is refused: one error line, exit 2, nothing written
        other = run_peer(
            *swarm_peer_args(tiny_config, bootstrap_peer, tmp_path / "b", "--set", "model.d_model=64")
        )
        assert other.returncode == 2, other.stderr[-2000:]
        errors = [ln for ln in other.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "fingerprint" in errors[0], other.stderr[-2000:]
        assert not (tmp_path / "b" / "checkpoints").exists()
        for i, p in enumerate(procs):
            assert p.wait(timeout=200) == 0, (tmp_path / f"p{i}.err").read_text()[-3000:]
    finally:
        reap(procs)
    log = (tmp_path / "p3.err").read_text()
    assert "caught up with the swarm: dense fetched, 8/8 experts fetched" in log, log[-3000:]
    # the late peer's first evaluation (before its first step) already has the swarm's quality, it takes
    # part in rounds afterwards, and it ends with the others' weights (checked below with every replica)
    fresh = read_metrics(runs[0] / "metrics.jsonl")[0]["val_loss"]  # the shared init, at step 0
    joined = read_metrics(runs[3] / "metrics.jsonl")[0]["val_loss"]
    assert joined < fresh - 0.3, (fresh, joined)
    assert any(r.applied for r in round_records(runs[3]))
    ckpts = [load_checkpoint(latest_checkpoint(run / "checkpoints")) for run in runs]
    experts = [set(c.state["local_experts"]) for c in ckpts]
    assert set().union(*experts) == set(range(8)), experts  # coverage fills before replication
    assert all(len(e) == 4 for e in experts) and len({frozenset(e) for e in experts}) == 2  # aligned pairs

    rounds = [round_records(run) for run in runs]
    full = [r for rs in rounds for r in rs if r.dense_group >= 3 and "dense" in r.applied_groups]
    assert full, rounds  # at least one round averaged the dense weights across three peers or more
    for rs in rounds:
        for r in rs:
            assert not any("NaN" in why for why in r.rejected)
            assert r.round >= 1 and r.dense_group >= 1 and r.sync_seconds > 0 and r.bytes_recv >= r.bytes_sent
            # the round held snapshots and results of what it averaged plus fp16 downloads, nothing more
            cfg = load_config(tiny_config)
            averaged = sum(g.startswith("expert") for g in r.applied_groups)
            want = held_bytes(cfg.model, 4, averaged, len(r.downloaded), "dense" in r.applied_groups)
            assert r.host_bytes == want, (r, want)
    # The last round is synchronous (no local steps after it) and is followed by the final agreement, so
    # every peer ends with the same dense weights and every holder of an expert with the same copy: equal
    # in fp32 when the round averaged them, within fp16 where a peer adopted a copy over the wire.
    final = [rs[-1] for rs in rounds]
    assert all(r.last for r in final), final
    assert all(r.final_unsettled == [] for r in final), final
    adopted = {name for r in final for name in r.final_adopted}
    print(f"last rounds: {[(r.dense_group, r.expert_groups) for r in final]}; adopted {adopted}")
    models = [c.model for c in ckpts]

    def close(a, b, name):
        tol = 2e-3 * b.abs().max().item() if name in adopted else 1e-5
        return torch.allclose(a, b, atol=tol, rtol=0)

    for k in models[0]:
        if ".experts." not in k:
            assert all(close(models[i][k], models[0][k], "dense") for i in (1, 2, 3)), k
            continue
        for e in range(8):
            holders = [i for i in range(4) if e in experts[i]]
            ref = models[holders[0]][k][e]
            for i in holders[1:]:
                assert close(models[i][k][e], ref, f"expert{e}"), (k, e, i)
            for i in set(range(4)) - set(holders):  # a downloaded copy: fp16 on the wire
                assert torch.allclose(models[i][k][e], ref, atol=2e-3 * ref.abs().max().item(), rtol=0)
