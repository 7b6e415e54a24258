"""Joining a run: claim experts, catch up with the swarm's weights, and build the peer's sync hook.

    store, transport = HivemindStore(dht), HivemindTransport(dht, timing)
    local, peers = claim_experts(store, me, cfg)        # None when the config names the local experts
    trainer.setup(local_experts=local)
    caught = catch_up(transport, cfg.run_id, trainer.model, peers, timeout=30)   # swarm.net.catch_up
    trainer.sync = open_swarm_sync(cfg, dht, trainer.model, last_round_at, caught)

Claims: a joiner announces itself, gives simultaneous joiners a heartbeat period to appear, then all of
them settle who takes what the same way (``swarm.sync.settle_joiners``: the least covered experts first).
Catch-up (``swarm.net.catch_up``): a joiner of a run that has trained takes the dense weights from a peer
and each expert from one of its holders, each checked against what the other peers hold.
"""

from __future__ import annotations

import sys
import time

import hivemind

from swarm.config import RunConfig
from swarm.model import MoETransformer
from swarm.net.catch_up import CaughtUp
from swarm.net.group_layout import DENSE, dense_spec
from swarm.net.records import Heartbeat, expert_holders, publish_heartbeat, read_records
from swarm.net.transport import Store
from swarm.sync import settle_joiners

RETRY_S = 1.0


def claim_experts(store: Store, me: str, cfg: RunConfig) -> tuple[list[int] | None, dict[str, Heartbeat]]:
    """(our experts, or None when the config fixes them; the other live peers' heartbeats)."""
    hb_s = cfg.sync.heartbeat_s
    joining = Heartbeat(experts=[], state="joining", period_s=hb_s)
    publish_heartbeat(store, cfg.run_id, me, joining, ttl_s=3 * hb_s)
    time.sleep(cfg.sync.join_settle_s)
    beats = read_live_peers(store, me, cfg.run_id, timeout=10.0)
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


def read_live_peers(
    store: Store, me: str, run_id: str, timeout: float, tries: int = 3, pause: float = RETRY_S
):
    """The live peers' records, from a read that has our own record in it: a read that timed out, or that
    missed our record (the DHT node that answered has an older copy), may miss the others too, and a
    joiner that sees nobody takes the experts that others already train. After ``tries`` such reads,
    whatever the last one gave (a swarm whose DHT does not answer is joined as if empty, and said so)."""
    found = None
    for attempt in range(tries):
        found = read_records(store, run_id, timeout)
        if found is not None and me in found:
            break
        if attempt + 1 < tries:
            time.sleep(pause)
    else:
        print(f"warning: the swarm's records were not readable in {tries} tries; claiming experts "
              f"from what was read ({len(found or {})} peers)", file=sys.stderr)  # fmt: skip
    return {p: rec for p, rec in (found or {}).items() if rec[0].state != "leaving"}


def open_swarm_sync(
    cfg: RunConfig,
    dht: hivemind.DHT,
    model: MoETransformer,
    last_round_at: float | None,
    caught_up: CaughtUp | None = None,
):
    """The hook of a peer on hivemind: its store, transport, heartbeat (``Membership``) and ``SwarmSync``
    (starting from the reference we caught up with, if any)."""
    from swarm.net.dht_node import visible_maddrs
    from swarm.net.hivemind_transport import HivemindStore, HivemindTransport, copy_bound
    from swarm.net.membership import Membership
    from swarm.net.swarm_sync import SwarmSync
    from swarm.net.timing import Timing
    from swarm.net.traffic import TrafficMeter
    from swarm.sync.codecs import codec_named
    from swarm.sync.robust_mean import aggregation_rule

    timing = Timing.from_config(cfg.sync)
    rule = aggregation_rule(cfg.sync.aggregation, cfg.sync.clip_factor)
    codec, dense_codec = codec_named(cfg.sync.codec), codec_named(cfg.sync.dense_codec_name)
    store = HivemindStore(dht)
    transport = HivemindTransport(dht, timing, codec, rule, copy_bound(model), dense_codec)
    members = Membership(
        store, transport.me, cfg.run_id, timing, list(model.local_experts), cfg.model.n_experts,
        cfg.sync.orphan_grace_s, visible_maddrs(dht),
    )  # fmt: skip
    sync = SwarmSync(cfg, store, transport, model, members, last_round_at, TrafficMeter(dht.pid))
    if caught_up is not None and caught_up.reference is not None:
        sync.ctx.payloads.adopt(dense_spec(cfg.run_id), caught_up.reference[0],
                                {DENSE: caught_up.reference[1]})  # fmt: skip
    if caught_up is not None:
        sync.ctx.downloads.judge_by_prints(caught_up.unverified)
        sync.copies_from(caught_up.copy_steps)
    return sync
