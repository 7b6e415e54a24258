"""Peers of ``SwarmSync`` in one process on the in-memory network, with real models and a stand-in for
training: what ``test_swarm_sync`` and ``test_first_round`` run."""

import threading
import time

import torch

from swarm.config import ModelConfig, RunConfig, SyncConfig
from swarm.model import MoETransformer
from swarm.net.local_transport import LocalNetwork
from swarm.net.membership import Membership
from swarm.net.swarm_sync import SwarmSync
from swarm.net.timing import Timing
from swarm.train.sync_hook import StepReport

MODEL = ModelConfig(
    vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_experts=4, expert_hidden=8, max_seq_len=256
)
# exact averages (fp32) unless a test names another codec: the in-memory network takes its codec apart
SYNC = SyncConfig(
    sync_every=5,
    matchmaking_s=0.3,
    round_timeout_s=4.0,
    heartbeat_s=0.2,
    download_timeout_s=1.0,
    codec="fp32",
)


def peer(net: LocalNetwork, me: str, experts: list[int], seed: int, sync: SyncConfig = SYNC):
    cfg = RunConfig(run_id="t", model=MODEL, sync=sync)
    model = MoETransformer(MODEL, experts)
    model.init_weights(0)  # the same initialisation on every peer, then some training of each peer's own
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    timing = Timing.from_config(sync)
    members = Membership(net.store(me), me, "t", timing, experts, MODEL.n_experts, SYNC.orphan_grace_s)
    return model, SwarmSync(cfg, net.store(me), net.transport(me), model, members)


def train(
    model: MoETransformer,
    sync: SwarmSync,
    steps: int,
    seed: int,
    out: dict,
    me: str,
    step_s: float = 0.15,
    start_at: float | None = None,
) -> None:
    """Stand-in for training: each step moves the local weights a little, then calls the hook. The first
    step is taken at wall time ``start_at`` (None: at once)."""
    time.sleep(max(0.0, (start_at or 0.0) - time.time()))
    gen = torch.Generator().manual_seed(seed)
    records = []
    with torch.no_grad():
        for step in range(1, steps + 1):
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))
            tokens = torch.zeros(MODEL.n_experts, dtype=torch.long)
            tokens[model.local_experts] = 64
            report = StepReport(step, 64 * step, 64, tokens, 1.0, last=step == steps, steps_left=steps - step)
            records += sync.after_step(model, report).records
            threading.Event().wait(step_s)  # a step takes time: the round runs meanwhile
        records += sync.last_round(
            model, StepReport(steps, 64 * steps, 0, torch.zeros(4, dtype=torch.long), 0.0)
        )
    out[me] = records


def see_each_other(peers: dict) -> None:
    """Every peer reads the swarm twice: by the second read every peer's record is out, so each view has
    them all (the tests that drive ``after_step`` by hand, before any heartbeat period has passed)."""
    for _ in range(2):
        for _, sync in peers.values():
            sync.members.refresh(timeout=1.0)


def finished_rounds(peers: dict) -> dict:
    """Each peer's one round, once it has ended (the tests that drive ``after_step`` by hand)."""
    out = {}
    for me, (model, sync) in peers.items():
        sync.wait_for_round()
        (out[me],) = sync.apply_finished(model)
    return out


def run(
    peers: dict, steps: int | dict = 30, step_s: dict | None = None, first_at: dict | None = None
) -> dict:
    """Every peer trains (``train``) in a thread of its own, from ``first_at[me]`` if given; then leaves."""
    out, threads = {}, []
    for i, (me, (model, sync)) in enumerate(peers.items()):
        n, dt = steps[me] if isinstance(steps, dict) else steps, (step_s or {}).get(me, 0.15)
        at = (first_at or {}).get(me)
        threads.append(threading.Thread(target=train, args=(model, sync, n, i, out, me, dt, at)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for _, sync in peers.values():
        sync.close()
    return out
