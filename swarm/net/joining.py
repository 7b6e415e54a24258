"""Joining a run: claim experts, catch up with the swarm's weights, and build the peer's sync hook.

    store, transport = HivemindStore(dht), HivemindTransport(dht, timing)
    local, peers = claim_experts(store, me, cfg)        # None when the config names the local experts
    trainer.setup(local_experts=local)
    catch_up(transport, cfg.run_id, trainer.model, peers, timeout=30)
    trainer.sync = open_swarm_sync(cfg, dht, trainer.model, last_round_at)

Claims: a joiner announces itself, gives simultaneous joiners a heartbeat period to appear, then all of
them settle who takes what the same way (``swarm.sync.settle_joiners``: the least covered experts first).
Catch-up: a joiner of a run that has trained fetches the dense weights from a peer and each expert from
one of its holders, checked for shape and finiteness; what cannot be fetched keeps the initialisation.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import hivemind
import torch

from swarm.config import RunConfig
from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors, expert_tensors, overwrite
from swarm.net.group_layout import DENSE, GroupSpec, expert_item, served_dense, served_items
from swarm.net.records import Heartbeat, expert_holders, publish_heartbeat, read_heartbeats
from swarm.net.round_info import MAX_REFERENCE
from swarm.net.transport import GroupTransport, Store
from swarm.sync import settle_joiners

RETRY_S = 1.0


def claim_experts(store: Store, me: str, cfg: RunConfig) -> tuple[list[int] | None, dict[str, Heartbeat]]:
    """(our experts, or None when the config fixes them; the other live peers' heartbeats)."""
    hb_s = cfg.sync.heartbeat_s
    joining = Heartbeat(experts=[], state="joining", period_s=hb_s)
    publish_heartbeat(store, cfg.run_id, me, joining, ttl_s=3 * hb_s)
    time.sleep(cfg.sync.join_settle_s)
    beats = read_heartbeats(store, cfg.run_id)
    peers = {p: hb for p, (hb, _) in beats.items() if p != me}
    if cfg.experts.local is not None:
        return None, peers
    per_peer = cfg.experts.per_peer or cfg.model.n_experts
    training = {p: v for p, v in beats.items() if v[0].state != "joining"}
    joiners = sorted({p for p, v in beats.items() if v[0].state == "joining"} | {me})
    claims = settle_joiners(
        expert_holders(training, cfg.model.n_experts), joiners, cfg.model.n_experts, per_peer
    )
    return claims[me], peers


def _valid(tensors: list[torch.Tensor] | None, like: list[torch.Tensor]) -> bool:
    return (
        tensors is not None
        and len(tensors) == len(like)
        and all(
            tuple(t.shape) == tuple(m.shape) and t.is_floating_point() and bool(torch.isfinite(t).all())
            for t, m in zip(tensors, like, strict=True)
        )
    )


@dataclass(frozen=True)
class CaughtUp:
    """What ``catch_up`` fetched. ``reference``: with a lossy codec, the dense weights the peers' changes
    are against, and their id (what the dense copy we took is), so that our first round's changes are too."""

    dense: bool
    experts: int
    reference: tuple[str, list[torch.Tensor]] | None = None


def catch_up(
    transport: GroupTransport, run_id: str, model: MoETransformer, peers: dict[str, Heartbeat], timeout: float
) -> CaughtUp:
    """Overwrite ``model`` with the swarm's current weights where a peer can serve them. What could not
    be fetched keeps the shared initialisation."""
    by_step = sorted(peers, key=lambda p: -peers[p].step)
    fetched, reference = {"dense": 0, "experts": 0}, None
    like = dense_tensors(model)
    spec = GroupSpec(f"{run_id}_dense", (DENSE,))
    deadline = time.monotonic() + timeout
    while by_step and not fetched["dense"] and time.monotonic() < deadline:
        # a peer serves its dense weights between rounds, not while it averages them: ask the freshest
        # peers in turn until one answers, within the download bound
        for peer in by_step[:3]:
            left = max(1.0, deadline - time.monotonic())
            served = transport.fetch(peer, spec.name, left)
            got = None if served is None else served_dense(spec, served.meta, served.tensors, len(like))
            if _valid(got, like):
                overwrite(like, got)
                fetched["dense"] = 1
                ref = served.meta.get("ref")
                if isinstance(ref, str) and 0 < len(ref) <= MAX_REFERENCE:
                    reference = (ref, [t.detach().clone() for t in got])
                break
        else:
            time.sleep(RETRY_S)
    per_expert = len(expert_tensors(model, 0))
    missing = set(range(model.cfg.n_experts))
    for peer in by_step:  # each holder's served experts in one request
        wanted = missing & set(peers[peer].experts)
        if not wanted:
            continue
        served = transport.fetch(peer, f"{run_id}_experts", timeout)
        items = served_items(served.meta, served.tensors, per_expert) if served is not None else {}
        for e in sorted(wanted):
            got, like = items.get(expert_item(e)), expert_tensors(model, e)
            if _valid(got, like):
                overwrite(like, [t.float() for t in got])
                missing.discard(e)
                fetched["experts"] += 1
    print(
        f"caught up with the swarm: dense {'fetched' if fetched['dense'] else 'not available'}, "
        f"{fetched['experts']}/{model.cfg.n_experts} experts fetched",
        file=sys.stderr,
    )
    return CaughtUp(bool(fetched["dense"]), fetched["experts"], reference)


def open_swarm_sync(
    cfg: RunConfig,
    dht: hivemind.DHT,
    model: MoETransformer,
    last_round_at: float | None,
    caught_up: CaughtUp | None = None,
):
    """The hook of a peer on hivemind: its store, transport, heartbeat (``Membership``) and ``SwarmSync``
    (starting from the reference we caught up with, if any)."""
    from swarm.net.hivemind_transport import HivemindStore, HivemindTransport
    from swarm.net.membership import Membership
    from swarm.net.swarm_sync import SwarmSync
    from swarm.net.timing import Timing
    from swarm.net.traffic import TrafficMeter
    from swarm.sync.codecs import codec_named
    from swarm.sync.robust_mean import aggregation_rule

    timing = Timing.from_config(cfg.sync)
    rule = aggregation_rule(cfg.sync.aggregation, cfg.sync.clip_factor)
    store, transport = HivemindStore(dht), HivemindTransport(dht, timing, codec_named(cfg.sync.codec), rule)
    members = Membership(
        store, transport.me, cfg.run_id, timing, list(model.local_experts), cfg.model.n_experts,
        cfg.sync.orphan_grace_s,
    )  # fmt: skip
    sync = SwarmSync(cfg, store, transport, model, members, last_round_at, TrafficMeter(dht.pid))
    if caught_up is not None and caught_up.reference is not None:
        sync.ctx.payloads.adopt(GroupSpec(f"{cfg.run_id}_dense", (DENSE,)), caught_up.reference[0],
                                {DENSE: caught_up.reference[1]})  # fmt: skip
    return sync
