"""One peer over several local ranks: ``torchrun --nproc-per-node 2 -m peers.main`` (gloo on CPU) trains one
peer with DDP; only rank 0 talks to the swarm. Real processes on 127.0.0.1; every rank saves its weights
whenever the ranks are checked (``SWARM_RANK_DUMPS=1``), so the tests compare them independently of the
logged digest. torchrun starts each rank in a session of its own, so processes are tracked and reaped by
session (torchrun's and its ranks')."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from swarm.net.p2p_sockets import p2p_sockets, remove_stale_p2p_sockets, stale_p2p_sockets
from swarm.train.checkpoint import latest_checkpoint, load_checkpoint
from swarm.train.metrics_log import read_metrics
from tests.conftest import ROOT, peer_cmd, reap, round_records, swarm_peer_args, wait_until
from tests.process_table import processes

pytestmark = pytest.mark.timeout(150)

# 2 ranks and another peer share 2 cores: one thread each; gloo stays on loopback; ranks dump weights
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "SWARM_RANK_DUMPS": "1"}
STEP_TOKENS = 4 * 32  # micro_batch x seq_len of the tiny config, per rank


def start_two_ranks(args: list[str], log: Path) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 -m peers.main ARGS`` (torchrun as ``python -m
    torch.distributed.run`` of the running interpreter), in a session of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--shutdown-timeout", "60", "-m", "peers.main", "--no-progress", *args]
    with open(log, "a") as fh:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=ENV, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )


def torchrun_sessions(proc: subprocess.Popen) -> set[int]:
    """torchrun's session and its two ranks' (rank 0's hivemind processes stay in rank 0's), once both run."""
    ranks: list[int] = []

    def started() -> bool:
        ranks[:] = [pid for pid, (ppid, _) in processes().items() if ppid == proc.pid]
        return len(ranks) == 2

    wait_until(started, 60, "two ranks")
    return {proc.pid, *ranks}


def left_in(sids: set[int]) -> list[int]:
    return [pid for pid, (_, sid) in processes().items() if sid in sids]


def reap_sessions(sids: set[int]) -> None:
    """SIGKILL every process still in these sessions, by PID."""
    for pid in left_in(sids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def rank_dumps(run: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``{"round-step89": [rank 0's weights, rank 1's], ...}`` from ``run/rank_dumps``."""
    out: dict[str, list] = {}
    for path in sorted((run / "rank_dumps").glob("*-rank*.safetensors")):
        point, _, rank = path.stem.rpartition("-rank")
        out.setdefault(point, [None, None])[int(rank)] = load_file(path)
    return out


def assert_ranks_equal(run: Path) -> dict[str, list]:
    dumps = rank_dumps(run)
    for point, (r0, r1) in dumps.items():
        assert r0 is not None and r1 is not None, point
        assert r0.keys() == r1.keys()
        for k in r0:
            assert torch.equal(r0[k], r1[k]), (point, k)
    return dumps


def test_two_rank_peer_in_a_swarm(tiny_config, tmp_path, bootstrap_peer):
    ranked, plain = tmp_path / "ranked", tmp_path / "plain"
    sockets_before = p2p_sockets()
    # a shared stop: both peers meet for the last round; with the pooled moment, as the demo trains, whose
    # first half of a step the ranks must average before it is kept (or their weights part)
    extra = ("--stop-at", str(time.time() + 26), "--set", "train.pooled_moment=true")
    procs = [
        start_two_ranks(swarm_peer_args(tiny_config, bootstrap_peer, ranked, *extra), tmp_path / "r.log"),
        subprocess.Popen(
            peer_cmd(*swarm_peer_args(tiny_config, bootstrap_peer, plain, *extra)),
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "p.log", "w"),
            start_new_session=True,
        ),
    ]
    sids: set[int] = set()
    try:
        sids = torchrun_sessions(procs[0])
        codes = [p.wait(timeout=120) for p in procs]
        time.sleep(0.5)
        left = left_in(sids)
    finally:
        reap(procs)
        reap_sessions(sids)
    assert codes == [0, 0], (
        (tmp_path / "r.log").read_text()[-3000:],
        (tmp_path / "p.log").read_text()[-3000:],
    )
    assert left == [] and stale_p2p_sockets(sockets_before) == set()  # every process left in order

    # the ranks hold equal weights after every applied round and after training (compared here, tensor by
    # tensor), and the digest rank 0 logged agrees
    dumps = assert_ranks_equal(ranked)
    assert any(p.startswith("round-") for p in dumps) and any(p.startswith("trained-") for p in dumps), dumps
    metrics = read_metrics(ranked / "metrics.jsonl")
    checks = [r for r in metrics if "ranks_weight_spread" in r]
    assert checks and all(r["ranks"] == 2 and r["ranks_weight_spread"] == 0.0 for r in checks), checks
    assert any(r.get("ranks_check") == "end of training" for r in checks)
    # a step of the peer is a step of both ranks
    steps = [r for r in metrics if "loss" in r]
    assert steps and all(r["tokens"] == r["step"] * 2 * STEP_TOKENS for r in steps)
    # the two-rank peer is one of two training the dense weights: its steps ran as halves after that
    pools = [r["pools"] for r in metrics if "pools" in r]
    assert {"dense": 2, "experts": 1} in pools, pools

    # the swarm saw two peers: the two-rank process is one of them
    rounds = {run.name: round_records(run) for run in (ranked, plain)}
    applied = {name: [r for r in rs if "dense" in r.applied_groups] for name, rs in rounds.items()}
    assert all(applied.values()), rounds
    assert all(r.dense_group <= 2 for rs in rounds.values() for r in rs)
    assert any(r.dense_group == 2 for r in applied["plain"]), rounds["plain"]
    ids = {m for rs in rounds.values() for r in rs for m in r.members.get("dense", [])}
    assert len(ids) == 2, ids
    # rank 0's checkpoint holds the weights both ranks ended with
    ckpt = load_checkpoint(latest_checkpoint(ranked / "checkpoints"))
    last = max((p for p in dumps if p.startswith("round-")), key=lambda p: int(p.rpartition("step")[2]))
    if int(last.rpartition("step")[2]) == ckpt.step:  # the last round was applied: its broadcast is final
        for k, v in ckpt.model.items():
            assert torch.equal(v, dumps[last][1][k]), k


def test_two_rank_swarm_peer_stops_cleanly_on_sigterm(tiny_config, tmp_path, bootstrap_peer):
    run, log = tmp_path / "ranked", tmp_path / "r.log"
    sockets_before = p2p_sockets()
    proc = start_two_ranks(swarm_peer_args(tiny_config, bootstrap_peer, run), log)
    sids: set[int] = set()
    try:
        sids = torchrun_sessions(proc)
        wait_until(
            lambda: (
                (run / "metrics.jsonl").exists()
                and any(r.get("step", 0) >= 20 for r in read_metrics(run / "metrics.jsonl"))
            ),
            60,
            "20 steps",
        )
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
        sent = time.time()
        proc.wait(timeout=60)
        took = time.time() - sent
        time.sleep(0.5)
        left = left_in(sids)
    finally:
        reap([proc])
        reap_sessions(sids)
        removed = remove_stale_p2p_sockets(sockets_before)
    out = log.read_text()
    assert took < 30 + 15, out[-3000:]  # the round timeout + 15 s
    assert left == [] and removed == 0, out[-3000:]  # no rank or hivemind process left, no socket
    # both ranks stopped without an uncaught error (torchrun prefixes a rank's traceback with "[rankN]:";
    # its own SignalException traceback is expected)
    assert out.count("interrupted at step") == 1 and "]: Traceback" not in out, out[-3000:]
    ckpt = latest_checkpoint(run / "checkpoints")  # rank 0 wrote its checkpoint on the way out
    assert ckpt is not None and load_checkpoint(ckpt).step >= 20


def _collectives(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: ``average_gradients`` and the pools ``share_decisions`` hands out."""
    from types import SimpleNamespace

    from swarm.train.local_ranks import LocalRanks
    from swarm.train.sync_hook import Pools

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    ranks = LocalRanks(rank, 2, rank)
    ranks.init(torch.device("cpu"), timeout_s=30)
    try:
        a, b, c = (torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True),
                   torch.zeros(1, requires_grad=True))  # fmt: skip
        a.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        b.grad = torch.full((2, 2), 4.0 * rank)
        if rank == 0:
            c.grad = torch.tensor([6.0])  # rank 1 has none: it counts as zero
        ranks.average_gradients([a, b, c])
        model = SimpleNamespace(cfg=SimpleNamespace(n_experts=4))
        mine = Pools(3, 2) if rank == 0 else Pools(1, 1)
        shared = ranks.share_decisions(model, 7, [], [2, 0] if rank == 0 else None, rank == 0, mine)
        torch.save({"a": a.grad, "b": b.grad, "c": c.grad, "shared": shared}, f"{out}/rank{rank}.pt")
    finally:
        ranks.close()


@pytest.mark.timeout(60)
def test_ranks_average_gradients_and_share_rank_0s_pools(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from swarm.train.local_ranks import RankDecisions
    from swarm.train.sync_hook import Pools

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_collectives, args=(port, str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for g in got:  # the mean over both ranks, on both
        assert torch.equal(g["a"], torch.tensor([1.5, 3.0, 4.5]))
        assert torch.equal(g["b"], torch.full((2, 2), 2.0))
        assert torch.equal(g["c"], torch.tensor([3.0]))
        assert g["shared"] == RankDecisions(switch_to=[0, 2], stop=True, pools=Pools(3, 2))
