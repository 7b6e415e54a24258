"""A late joiner's catch-up: fetch the dense weights from a peer and every expert from one of its holders."""

from __future__ import annotations

import sys

import hivemind
import torch

from swarm.model import MoETransformer
from swarm.net.averaging import download_state
from swarm.net.expert_tensors import dense_tensors, expert_tensors, overwrite
from swarm.net.records import Heartbeat


def _valid(tensors: list[torch.Tensor], like: list[torch.Tensor]) -> bool:
    return len(tensors) == len(like) and all(
        tuple(t.shape) == tuple(m.shape) and t.is_floating_point() and bool(torch.isfinite(t).all())
        for t, m in zip(tensors, like, strict=True)
    )


def _fetch(dht, peers: list[str], prefix: str, like: list[torch.Tensor], timeout: float):
    for peer in peers:
        got = download_state(dht, peer, prefix, timeout=timeout)
        if got is not None and isinstance(got[0], dict) and "step" in got[0] and _valid(got[1], like):
            return [t.float() for t in got[1]]
    return None


def catch_up(
    dht: hivemind.DHT, run_id: str, model: MoETransformer, peers: dict[str, Heartbeat], timeout: float = 30.0
) -> dict[str, int]:
    """Overwrite ``model`` with the swarm's current weights where a peer can serve them. Returns counts of
    what was fetched; what could not be fetched keeps the shared initialisation."""
    by_step = sorted(peers, key=lambda p: -peers[p].step)
    fetched = {"dense": 0, "experts": 0}
    like = dense_tensors(model)
    got = _fetch(dht, by_step[:3], f"{run_id}_dense", like, timeout)
    if got is not None:
        overwrite(like, got)
        fetched["dense"] = 1
    for e in range(model.cfg.n_experts):
        holders = [p for p in by_step if e in peers[p].experts][:2]
        like = expert_tensors(model, e)
        got = _fetch(dht, holders, f"{run_id}_expert{e}", like, timeout)
        if got is not None:
            overwrite(like, got)
            fetched["experts"] += 1
    print(
        f"caught up with the swarm: dense {'fetched' if fetched['dense'] else 'not available'}, "
        f"{fetched['experts']}/{model.cfg.n_experts} experts fetched",
        file=sys.stderr,
    )
    return fetched
