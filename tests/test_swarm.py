"""A real swarm on 127.0.0.1: a bootstrap peer and three ``swarm-peer`` processes train and synchronise."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.config import load_config
from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets
from swarm.net.round_memory import held_bytes
from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import (
    ROOT,
    reap,
    round_records,
    run_peer,
    start_peer,
    swarm_peer_args,
    wait_for_maddr,
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
    assert "others may join through it: swarm-peer --config" in log  # any peer is an entry point
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
    # each peer's last val_loss is its evaluation after the final agreement: the same weights on the same
    # windows (the demo's summary reports it), not its last step's, from before the last round
    finals = [[r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1] for run in runs]
    assert [f["step"] for f in finals] == [rs[-1].step for rs in rounds], finals
    assert max(f["val_loss"] for f in finals) - min(f["val_loss"] for f in finals) < 1e-3, finals
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
                got = models[i][k][e]
                why = (k, e, i, final[i].final_downloaded, final[i].download_failures, final[i].rejected)
                assert torch.allclose(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=0), why


def _bootstrap(log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A ``swarm-bootstrap`` process in its own process group, and its multiaddr."""
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "bootstrap.main", *args], cwd=ROOT, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, wait_for_maddr(log, proc)


def test_churn_a_sole_holder_killed_and_resumed_a_bootstrap_killed_and_a_join_through_the_other(
    tiny_config, tmp_path
):
    """Issue 15's scenario: two bootstraps; two peers, each the sole holder of its 4 experts; kill -9 of one
    of them between its checkpoints (on the wall clock only), its restart, kill -9 of the first bootstrap, a
    join through the second; Ctrl+C of the joiner; the other two end with a last round together."""
    import math

    sockets_before = p2p_sockets()
    runs = [tmp_path / f"p{i}" for i in range(3)]
    boot_a, a = _bootstrap(tmp_path / "a.log")
    procs = [boot_a]
    boot_b, b = _bootstrap(tmp_path / "b.log", "--initial-peers", a)
    procs.append(boot_b)
    # peers 0 and 1 meet for their last round at the same time; the joiner needs ~15 s to start and catch up
    # while two peers train on the same two cores, then a round or two to meet both in a dense group of three
    # (at +70 s it had done so 31 to 36 s before the stop, in three runs)
    stop_at = str(time.time() + 58)

    def start(i, *extra):
        args = swarm_peer_args(tiny_config, a, runs[i], *extra)
        at = args.index("--initial-peers")
        args[at + 1 : at + 2] = [a, b]  # both bootstraps: a dead one is skipped
        # rounds on the wall clock: on steps, the two peers that round together stayed in step with each
        # other and the joiner could stay out of phase with them round after round (every dense group a pair
        # of three in view, dropped), until the shared stop (CI, once)
        extra = ["--set", "train.checkpoint_every=100000", "--set", "sync.sync_every_s=3"]
        return start_peer([*args, *extra], tmp_path / f"p{i}.err")

    def log(i):
        return (tmp_path / f"p{i}.err").read_text()

    def steps(i):
        return [r["step"] for r in read_metrics(runs[i] / "metrics.jsonl") if "loss" in r]

    def dense_rounds(i):
        return [r.step for r in round_records(runs[i]) if "dense" in r.applied_groups]

    try:
        procs.append(start(0, "--stop-at", stop_at))
        procs.append(start(1, "--stop-at", stop_at, "--set", "train.checkpoint_every_s=3"))
        # peer 1 has a checkpoint (of the wall clock: none by steps) and peer 0 a copy of its experts
        wait_until(lambda: len(dense_rounds(1)) >= 2 and latest_checkpoint(runs[1] / "checkpoints"), 90,
                   "two rounds and a checkpoint of peer 1")  # fmt: skip
        mine = set(load_checkpoint(latest_checkpoint(runs[1] / "checkpoints")).state["local_experts"])
        wait_until(lambda: any(mine <= set(r.downloaded) for r in round_records(runs[0])), 30, "copies at 0")
        time.sleep(1.0)
        os.killpg(procs[3].pid, signal.SIGKILL)  # the whole peer dies at once, as in a crash
        assert procs[3].wait(timeout=30) == -signal.SIGKILL
        killed_at, ckpt = max(steps(1)), load_checkpoint(latest_checkpoint(runs[1] / "checkpoints"))
        assert 0 < ckpt.step <= killed_at and ckpt.step % 100000 != 0
        time.sleep(1)  # its orphaned children (DHT, p2pd, averagers) died with the group
        procs.append(start(1, "--stop-at", stop_at, "--resume"))  # same run dir: same peer id, same step
        wait_until(lambda: log(1).count("caught up with the swarm") == 1, 60, "peer 1 caught up")
        os.killpg(boot_a.pid, signal.SIGKILL)  # the first entry point dies
        assert boot_a.wait(timeout=30) == -signal.SIGKILL
        procs.append(start(2))  # joins through the second bootstrap, the first one given being dead
        wait_until(lambda: len(dense_rounds(2)) >= 1, float(stop_at) - time.time(), "a dense round of the joiner",
                   lambda: f"{log(2)[-2000:]}\n{round_records(runs[2])}\n{round_records(runs[1])[-3:]}")  # fmt: skip
        # Ctrl+C of a peer in the middle of training: it checkpoints where it is and leaves within a round
        # timeout (30 s) + 15 s, whatever its round was doing
        os.killpg(procs[5].pid, signal.SIGINT)
        interrupted = time.monotonic()
        assert procs[5].wait(timeout=60) == 130, log(2)[-3000:]
        assert time.monotonic() - interrupted < 30 + 15
        saved = load_checkpoint(latest_checkpoint(runs[2] / "checkpoints")).step
        assert f"interrupted at step {saved}:" in log(2) and steps(2)[-1] <= saved <= steps(2)[-1] + 1
        for i in (2, 4):  # peers 0 and 1 end together
            assert procs[i].wait(timeout=150) == 0, log(i // 2 - 1)[-3000:]
        boot_b.terminate()
        assert boot_b.wait(timeout=30) == 0
    finally:
        reap(procs)  # every process group we started, by PID (stacks of the stuck first)
        remove_stale_p2p_sockets(sockets_before)  # the killed peer's daemon could not remove its own

    # the restarted peer: the same peer id, resumed from its step, none of its experts back to the start
    ids = [ln.split()[2].rstrip(";") for ln in log(1).splitlines() if ln.startswith("peer id: ")]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert f"resumed from {runs[1] / 'checkpoints'}" in log(1) and f"at step {ckpt.step} " in log(1)
    after = [s for s in steps(1) if s > ckpt.step]
    assert after and after[0] == ckpt.step + 1, after[:3]
    caught = [ln for ln in log(1).splitlines() if ln.startswith("caught up with the swarm")]
    assert "start from the initialisation" not in caught[0], caught
    fresh = read_metrics(runs[0] / "metrics.jsonl")[0]["val_loss"]  # the shared initialisation, at step 0
    back = next(r["val_loss"] for r in read_metrics(runs[1] / "metrics.jsonl") if r.get("step") == ckpt.step
                and "val_loss" in r and "loss" not in r)  # fmt: skip
    assert back < fresh - 0.3, (fresh, back)
    # the joiner came in through the second bootstrap and took every expert
    joined = [ln for ln in log(2).splitlines() if ln.startswith("caught up with the swarm")]
    assert joined and "dense fetched, 8/8 experts fetched" in joined[0], joined

    # peers 0 and 1 ended with a last round together: the same dense weights and experts
    def ends():  # both peers' last rounds, for a failure's message
        return [[(r.round, r.last, r.dense_group, r.reason[:60], round(r.sync_seconds, 1), r.final_unsettled)
                 for r in round_records(runs[j])[-4:]] for j in (0, 1)]  # fmt: skip

    for i in (0, 1):
        rounds = round_records(runs[i])
        assert rounds[-1].last and rounds[-1].final_unsettled == [], (i, ends())
        assert all(math.isfinite(r.sync_seconds) and r.sync_seconds <= 30 + 5 for r in rounds)
    c0, c1 = (load_checkpoint(latest_checkpoint(runs[i] / "checkpoints")) for i in (0, 1))
    for k, t in c0.model.items():
        tol = 1e-5 if ".experts." not in k else 2e-3  # a non-holder's copy came over the wire in fp16
        assert torch.allclose(t, c1.model[k], atol=tol * max(1.0, t.abs().max().item()), rtol=0), k
