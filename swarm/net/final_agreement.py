"""After the last round: make every replica of a tensor group the same, even where that round failed.

    adopted, unsettled = agree_on_final_copies(store, run_id, me, items, fetch, serve, timeout=10, ...)

A synchronous last round normally leaves the holders of each group equal. But a round can fail on one
holder and not on another (hivemind may drop a member during matchmaking; a digest may arrive after a
partner's deadline), and then their copies differ for good, because nobody trains or averages afterwards.
So every peer that is finishing publishes a digest of each group it holds (dense, its experts) under a
per-group key, waits for the other finishing holders that are still live (one may still be in the round it
had in flight, then in its last round), and the copies are compared: the largest set of agreeing copies
wins (ties: the one with the smallest peer id), and a peer whose copy differs downloads the winner's
(checked like any received tensor) and serves that from then on. Everybody computes the same winner from
the same digests, so no further messages are needed; a holder whose digest never came is reported as
unsettled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from swarm.net.records import Heartbeat
from swarm.net.round_consensus import REL_TOLERANCE, digest, digests_agree
from swarm.net.transport import Store
from swarm.sync import RejectedTensor, check_tensors


@dataclass(frozen=True)
class FinalItem:
    """One item to agree on (the dense weights, or one expert): the live tensors, and the peers (other than
    us) that hold it and are finishing too."""

    tensors: list[torch.Tensor]
    others: frozenset[str]


def finishing_holders(peers: Mapping[str, Heartbeat], me: str, item: str) -> frozenset[str]:
    """The other finishing peers that hold ``item``: every one for the dense weights."""
    ending = {p for p, hb in peers.items() if hb.state in ("finishing", "done")} - {me}
    if item == "dense":
        return frozenset(ending)
    e = int(item.removeprefix("expert"))
    return frozenset(p for p in ending if e in peers[p].experts)


def winner(copies: dict[str, list[float]], tolerance: float = REL_TOLERANCE) -> str:
    """The peer whose copy everyone adopts: largest set of agreeing digests, then smallest peer id."""
    peers = sorted(copies)
    support = {p: sum(digests_agree(copies[p], copies[q], tolerance) for q in peers) for p in peers}
    return max(peers, key=lambda p: (support[p], [-ord(c) for c in p]))


def agree_on_final_copies(
    store: Store,
    run_id: str,
    me: str,
    items: dict[str, FinalItem],
    fetch: Callable[[str, str], list[torch.Tensor] | None],
    serve: Callable[[str, list[torch.Tensor]], None],
    timeout: float,
    max_rel_distance: float,
    window: float = 60.0,
    wait: float | None = None,
    poll: float = 0.25,
    tolerance: float = REL_TOLERANCE,
    still_coming: Callable[[str], bool] = lambda peer: True,
) -> tuple[list[str], list[str]]:
    """Returns (items whose copy we replaced with the winner's, items we could not settle and why).
    ``fetch(peer, item)`` downloads a peer's copy; ``serve(item, tensors)`` makes ours what we serve.
    ``timeout`` bounds each read and download, ``wait`` (default ``timeout``) the wait for the other
    holders' digests: a holder still in its last round publishes later, and a peer that decided without
    its digest could keep a copy that the late ones replace. A digest that never came is reported.
    Digests published more than ``window`` seconds before ours belong to an earlier end and are ignored.
    ``still_coming(peer)``: whether a holder whose digest is missing is still worth waiting for (it is
    live); the wait ends early once no missing holder is.
    ``tolerance``: how far digests of equal copies may differ (0 after a lossy codec's last round, whose
    members end a codec's error apart: any difference is settled by a download)."""
    started = store.now()
    unannounced: dict[str, list[float]] = {}

    def announce(name: str, value: list[float]) -> None:
        # each try expires later than the last: a DHT node that kept a try which reported failure refuses
        # another of the same expiration, and the try would fail for ever
        now = store.now()
        record = {"digest": value, "time": now}
        stored = store.put(f"{run_id}_final_{name}", record, now + 2 * window, subkey=me, timeout=timeout)
        if stored:
            unannounced.pop(name, None)
        else:  # a store that failed (a loaded DHT) is tried again while we wait: the others wait for it
            unannounced[name] = value

    mine = {}
    for name, item in items.items():
        copy = [t.detach().to("cpu", torch.float32, copy=True) for t in item.tensors]
        serve(name, copy)  # served before the digest is out: whoever adopts ours gets this copy
        mine[name] = digest(copy)
        announce(name, mine[name])
    seen: dict[str, dict[str, list[float]]] = {name: {me: d} for name, d in mine.items()}

    def missing(name: str) -> frozenset[str]:
        return items[name].others - seen[name].keys()

    deadline = time.monotonic() + (timeout if wait is None else wait)
    retry_until = time.monotonic() + timeout  # our own stores: tried again while we wait, or this long
    pending = {name for name, item in items.items() if item.others}

    def busy() -> bool:  # digests to wait for, or ours still to store
        return bool(pending) or bool(unannounced) and time.monotonic() < retry_until

    while busy() and time.monotonic() < deadline:
        for name, value in list(unannounced.items()):
            announce(name, value)
        for name in list(pending):
            found = store.get_subkeys(f"{run_id}_final_{name}", max(0.1, deadline - time.monotonic()))
            for peer, (v, _) in (found or {}).items():
                recent = isinstance(v, dict) and isinstance(v.get("time"), (int, float))
                if peer in items[name].others and recent and v["time"] > started - window:
                    d = v.get("digest")
                    if isinstance(d, list) and len(d) == len(mine[name]):
                        seen[name][peer] = d
            if not any(still_coming(p) for p in missing(name)):
                pending.discard(name)
        if busy():
            time.sleep(poll)
    unsettled = [f"{name}: no digest from {len(missing(name))} holder(s)" for name in items if missing(name)]
    adopted = []
    # a holder's copy can be out of reach for a moment (on 2 cores: 1 test swarm in about 10 left an expert
    # unsettled after one failed download): a download that fails is tried again for ``timeout``
    fetch_until = time.monotonic() + timeout
    for name, item in items.items():
        best = winner(seen[name], tolerance)
        if best == me or digests_agree(mine[name], seen[name][best], tolerance):
            continue
        tensors = fetch(best, name)
        while tensors is None and time.monotonic() + poll < fetch_until:
            time.sleep(poll)
            tensors = fetch(best, name)
        if tensors is None:
            unsettled.append(f"{name}: no copy from {best[-8:]}")
            continue
        tensors = [t.float() for t in tensors]
        try:
            check_tensors(name, tensors, item.tensors, max_rel_distance)
        except RejectedTensor as e:
            unsettled.append(f"{name}: {e}")
            continue
        with torch.no_grad():
            for dst, src in zip(item.tensors, tensors, strict=True):
                dst.copy_(src.to(dst.device, dst.dtype))
        serve(name, tensors)
        announce(name, digest(tensors))  # a peer that arrives later sees the copy we hold now
        adopted.append(name)
    return adopted, unsettled
