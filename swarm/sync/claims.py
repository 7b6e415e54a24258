"""Which experts a peer trains: fewest live holders first, so coverage fills up before replication."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Set


def _tie_break(peer_id: str, expert: int) -> bytes:
    # Peers that join at the same moment see the same holder counts; hashing (peer, expert) spreads them
    # over different experts instead of all taking expert 0, yet every peer computes the same order.
    return hashlib.sha256(f"{peer_id}:{expert}".encode()).digest()


def choose_experts(holders: Mapping[int, Set[str]], n_experts: int, per_peer: int, peer_id: str) -> list[int]:
    """The ``per_peer`` experts with the fewest live holders (other than ``peer_id``); among equally held
    experts, those with the same holders together (a replicating peer copies another peer's set, so that
    replicas stay aligned and each set of co-holders averages as one group), then deterministically by a
    hash of (peer id, expert). Returns them sorted."""
    if not 1 <= per_peer <= n_experts:
        raise ValueError(f"per_peer must be in [1, {n_experts}], got {per_peer}")

    def load(e: int) -> tuple[int, list[str], bytes]:
        others = set(holders.get(e, ())) - {peer_id}
        return len(others), sorted(others), _tie_break(peer_id, e)

    return sorted(sorted(range(n_experts), key=load)[:per_peer])


def orphan_swap(
    mine: list[int],
    holders: Mapping[int, Set[str]],
    orphaned_for: Mapping[int, float],
    grace_s: float,
    peer_id: str,
) -> tuple[int, int] | None:
    """If some expert has had no live holder for ``grace_s`` seconds and every expert of this peer is
    replicated (another live holder exists), return (expert to give up, orphan to take); else None.

    The expert given up is the most replicated one; the orphan is the longest orphaned, ties by id: every
    eligible peer goes for the same orphan, so that ``orphan_claim_rank`` lets one of them take it. (With
    ties by a per-peer hash, two peers each ranked first for a different orphan claimed in the same
    heartbeat, and could have given up the same expert.)"""
    orphans = [
        e
        for e, since in orphaned_for.items()
        if since >= grace_s and not (set(holders.get(e, ())) - {peer_id})
    ]
    if not orphans:
        return None
    replication = {e: len(set(holders.get(e, ())) - {peer_id}) for e in mine}
    if not mine or min(replication.values()) < 1:
        return None
    take = max(orphans, key=lambda e: (orphaned_for[e], -e))
    give = max(mine, key=lambda e: (replication[e], _tie_break(peer_id, e)))
    return give, take


def orphan_claim_rank(orphan: int, holders: Mapping[int, Set[str]], peer_id: str) -> int | None:
    """Where ``peer_id`` stands among the peers that may take ``orphan`` (every expert they hold has another
    live holder), ordered by a hash of (peer, orphan) that every peer computes alike; None if not eligible.
    Rank r waits r extra heartbeat periods, so normally exactly one peer takes the orphan."""
    held: dict[str, list[int]] = {}
    for e, peers in holders.items():
        for p in peers:
            held.setdefault(p, []).append(e)
    eligible = [p for p, mine in held.items() if all(len(holders[e]) >= 2 for e in mine)]
    if peer_id not in eligible:
        return None
    return sorted(eligible, key=lambda p: _tie_break(p, orphan)).index(peer_id)


def settle_joiners(
    holders: Mapping[int, Set[str]], joining: list[str], n_experts: int, per_peer: int
) -> dict[str, list[int]]:
    """Claims for peers joining at the same moment. Each claims in turn, in peer-id order, seeing the
    claims made before it; every joiner runs the same computation on the same records, so they agree
    without talking, and coverage still fills before replication."""
    taken: dict[int, set[str]] = {e: set(holders.get(e, ())) for e in range(n_experts)}
    out = {}
    for peer in sorted(joining):
        out[peer] = choose_experts(taken, n_experts, per_peer, peer)
        for e in out[peer]:
            taken[e].add(peer)
    return out
