"""After the last round: make every replica of a tensor group the same, even where that round failed.

    adopted = agree_on_final_copies(dht, run_id, me, groups, timeout=10)

A synchronous last round normally leaves the holders of each group equal. But a round can fail on one
holder and not on another (hivemind may drop a member during matchmaking; a digest may arrive after a
partner's deadline), and then their copies differ for good, because nobody trains or averages afterwards.
So every peer that is finishing publishes a digest of each group it holds (dense, its experts) under a
per-group key, waits briefly for the other finishing holders, and the copies are compared: the largest set
of agreeing copies wins (ties: the one with the smallest peer id), and a peer whose copy differs downloads
the winner's (checked like any received tensor) and serves that from then on. Everybody computes the same
winner from the same digests, so no further messages are needed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import hivemind
import torch
from hivemind.utils import get_dht_time

from swarm.model import MoETransformer
from swarm.net.averaging import AveragingGroup, download_state
from swarm.net.expert_tensors import dense_tensors, expert_tensors, overwrite, snapshot
from swarm.net.records import Heartbeat
from swarm.net.round_consensus import digest, digests_agree
from swarm.sync import RejectedTensor, check_tensors


@dataclass
class FinalGroup:
    """One tensor group to agree on: its averaging group (which serves it), the live tensors, and the
    peers (other than us) that hold it and are finishing too."""

    group: AveragingGroup
    tensors: list[torch.Tensor]
    others: set[str]


def final_groups(
    peers: Mapping[str, Heartbeat],
    me: str,
    dense_group: AveragingGroup,
    expert_groups: Mapping[int, AveragingGroup],
    model: MoETransformer,
) -> dict[str, FinalGroup]:
    """The groups to settle: the dense weights among every other finishing peer, each of our experts among
    its finishing holders."""
    ending = {p for p, hb in peers.items() if hb.state in ("finishing", "done")} - {me}
    groups = {"dense": FinalGroup(dense_group, dense_tensors(model), ending)}
    for e, group in expert_groups.items():
        holders = {p for p, hb in peers.items() if e in hb.experts}
        groups[f"expert{e}"] = FinalGroup(group, expert_tensors(model, e), ending & holders)
    return groups


def winner(copies: dict[str, list[float]]) -> str:
    """The peer whose copy everyone adopts: largest set of agreeing digests, then smallest peer id."""
    peers = sorted(copies)
    support = {p: sum(digests_agree(copies[p], copies[q]) for q in peers) for p in peers}
    return max(peers, key=lambda p: (support[p], [-ord(c) for c in p]))


def agree_on_final_copies(
    dht: hivemind.DHT,
    run_id: str,
    me: str,
    groups: dict[str, FinalGroup],
    meta: dict,
    timeout: float,
    max_rel_distance: float,
    window: float = 60.0,
    poll: float = 0.25,
) -> tuple[list[str], list[str]]:
    """Returns (groups whose copy we replaced with the winner's, groups we could not settle and why).
    Digests published more than ``window`` seconds before ours belong to an earlier end and are ignored."""
    started = get_dht_time()

    def announce(name: str, value: list[float]) -> None:
        record = {"digest": value, "time": get_dht_time()}
        dht.store(f"{run_id}_final_{name}", record, started + 2 * window, subkey=me, return_future=True)

    mine = {}
    for name, g in groups.items():
        local = snapshot(g.tensors)
        g.group.publish(local, meta)  # served before the digest is out: whoever adopts ours gets this copy
        mine[name] = digest(local)
        announce(name, mine[name])
    seen: dict[str, dict[str, list[float]]] = {name: {me: d} for name, d in mine.items()}
    deadline = time.monotonic() + timeout
    pending = {name for name, g in groups.items() if g.others}
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            try:
                found = dht.get(f"{run_id}_final_{name}", latest=True, return_future=True).result(
                    timeout=max(0.1, deadline - time.monotonic())
                )
            except Exception:
                found = None
            value = found.value if found is not None and isinstance(found.value, dict) else {}
            for peer, item in value.items():
                v = getattr(item, "value", None)
                recent = isinstance(v, dict) and isinstance(v.get("time"), (int, float))
                if peer in groups[name].others and recent and v["time"] > started - window:
                    if isinstance(v.get("digest"), list) and len(v["digest"]) == len(mine[name]):
                        seen[name][peer] = v["digest"]
            if groups[name].others <= set(seen[name]):
                pending.discard(name)
        if pending:
            time.sleep(poll)
    adopted, unsettled = [], []
    for name, g in groups.items():
        best = winner(seen[name])
        if best == me or digests_agree(mine[name], seen[name][best]):
            continue
        got = download_state(dht, best, g.group.prefix, timeout=max(1.0, timeout))
        if got is None:
            unsettled.append(f"{name}: no copy from {best[-8:]}")
            continue
        tensors = [t.float() for t in got[1]]
        try:
            check_tensors(name, tensors, snapshot(g.tensors), max_rel_distance)
        except RejectedTensor as e:
            unsettled.append(f"{name}: {e}")
            continue
        overwrite(g.tensors, tensors)
        g.group.publish(tensors, meta)
        announce(name, digest(tensors))  # a peer that arrives later sees the copy we hold now
        adopted.append(name)
    return adopted, unsettled
