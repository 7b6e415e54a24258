"""A joiner of a run that has trained takes the swarm's current weights: the dense weights from a peer, each
expert from one of its holders (or, where no live holder serves it, the newest copy any peer holds), each
copy checked against what the other peers hold.

    caught = catch_up(transport, "demo", model, peers, timeout=30.0)
    caught = catch_up(..., held={3: 1200})  # resumed at step 1200 holding expert 3: only a newer copy wins
    caught.dense, caught.experts         # what was taken
    caught.copy_steps, caught.from_init  # the step of each copy taken; experts no valid copy exists of
    caught.reference                     # with a lossy codec: the dense weights the peers' changes are against
    caught.unverified                    # {expert: (the swarm's print, its step)} for experts still at the init

An expert outlives its holders: every peer serves its copies of the experts it does not train, each with
the step it is from (``CopyServer``); an expert that no live holder gives us is taken from the peer with
the newest copy, the next newest where that one is refused. Only where no copy exists does it keep the
initialisation, and the catch-up line says so.

Every peer serves, with its dense weights, prints of every copy it holds (``served_prints``): before
anything is taken, the joiner asks the peers for them (metadata only). A copy offered by one peer is
compared with the median print of the others (``PrintViews.doubt``): a negated, zeroed or scaled copy is
refused and the next peer's taken instead; how far its norm may be off grows with the steps between it and
the printed copies. Where no other peer serves a print (a swarm of one, or a
round under way everywhere), a copy passes the shape and finiteness checks only. What cannot be taken
keeps the shared initialisation, and the swarm's print of it is kept for the first download to be judged
by (``ExpertDownloads.judge_by_prints``): the initialisation is no reference for a trained expert.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

import torch

from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors, expert_tensors, overwrite
from swarm.net.group_layout import DENSE, dense_spec, expert_item, served_dense, served_items
from swarm.net.records import Heartbeat
from swarm.net.round_info import MAX_REFERENCE
from swarm.net.served_prints import PrintViews, gather_metadata, gather_prints
from swarm.net.served_steps import served_steps
from swarm.net.transport import GroupTransport

RETRY_S = 1.0
PRINTS_S = 10.0  # how long to wait for the prints of peers that have had a round but did not answer
ASKED = 8  # peers asked for prints and dense weights: the freshest ones
ENOUGH_VIEWS = 3  # prints of this many peers make a majority for any one copy: no need to wait for more


@dataclass(frozen=True)
class CaughtUp:
    """What ``catch_up`` took. ``reference``: with a lossy codec, the dense weights the peers' changes are
    against, and their id (what the dense copy we took is), so that our first round's changes are too."""

    dense: bool
    experts: int
    reference: tuple[str, list[torch.Tensor]] | None = None
    unverified: dict[int, tuple[torch.Tensor, int | None]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # why offered copies were not taken
    copy_steps: dict[int, int] = field(default_factory=dict)  # expert -> the step of the copy taken
    from_init: list[int] = field(default_factory=list)  # experts of which no copy exists in the swarm


def _valid(tensors: list[torch.Tensor] | None, like: list[torch.Tensor]) -> bool:
    return (
        tensors is not None
        and len(tensors) == len(like)
        and all(
            tuple(t.shape) == tuple(m.shape) and t.is_floating_point() and bool(torch.isfinite(t).all())
            for t, m in zip(tensors, like, strict=True)
        )
    )


def _gather(transport: GroupTransport, name: str, peers: list[str], timeout: float) -> PrintViews:
    """Prints of as many peers as answer within ``timeout``; enough once ENOUGH_VIEWS have."""
    views, deadline = PrintViews(), time.monotonic() + timeout
    while True:
        asked = [p for p in peers if not views.prints.get(p)]
        left = deadline - time.monotonic()
        if not asked or left <= 0:
            return views
        views |= gather_prints(transport, name, asked, max(0.5, min(5.0, left)))
        if sum(1 for v in views.prints.values() if v) >= min(len(peers), ENOUGH_VIEWS):
            return views
        time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))


def catch_up(
    transport: GroupTransport,
    run_id: str,
    model: MoETransformer,
    peers: dict[str, Heartbeat],
    timeout: float,
    held: dict[int, int] | None = None,
    lr: float | None = None,
) -> CaughtUp:
    """See the module docstring. ``held``: the step of the copies we hold of some experts (a peer resumed
    from a checkpoint holds its own experts as of that step): only newer copies replace them. ``lr``: the
    peers' peak learning rate, which bounds how far a copy may have grown since the printed ones."""
    held = held or {}
    by_step = sorted(peers, key=lambda p: -peers[p].step)[:ASKED]
    spec = dense_spec(run_id)
    deadline = time.monotonic() + timeout
    # a peer serves prints from its first round on: waiting for one that is joining too would be in vain
    serving = [p for p in by_step if peers[p].last_round >= 0]
    views = _gather(transport, spec.name, serving, min(PRINTS_S, timeout / 2))
    refused: list[str] = []
    doubted: dict[int, set[str]] = {}  # expert -> the peers whose copy of it we refused
    views = dataclasses.replace(views, lr=lr)
    dense, reference = _take_dense(transport, spec, model, by_step, views, deadline, refused)
    taken = _take_experts(transport, run_id, model, peers, views, timeout, (refused, doubted))
    missing = sorted(set(range(model.cfg.n_experts)) - set(taken))
    taken |= _take_copies(
        transport, run_id, model, by_step, views, missing, held, timeout, (refused, doubted)
    )
    from_init = [e for e in missing if e not in taken and held.get(e, 0) <= 0]
    kept = [e for e in missing if e not in taken and held.get(e, 0) > 0]
    init_note = f"; experts {from_init} start from the initialisation (no valid copy in the swarm)"
    kept_note = f"; experts {kept} kept as checkpointed (no newer copy in the swarm)"
    print(
        f"caught up with the swarm: dense {'fetched' if dense else 'not available'}, "
        f"{len(taken)}/{model.cfg.n_experts} experts fetched (checked against {len(views.prints)} peers' prints)"
        + "".join(f"; refused {why}" for why in refused)
        + (kept_note if kept else "")
        + (init_note if from_init else ""),
        file=sys.stderr,
    )
    unverified = {}  # the swarm's view of an expert we could not take, to judge our first download of it by
    for e in (e for e in from_init if e not in model.local_experts):
        ref = views.without(doubted.get(e, set())).reference(expert_item(e), exclude="")
        if ref[0] is not None:
            unverified[e] = ref
    return CaughtUp(dense, len(taken), reference, unverified, refused, taken, from_init)


def _take_dense(transport, spec, model, by_step, views, deadline, refused) -> tuple[bool, tuple | None]:
    like, candidates = dense_tensors(model), list(by_step)
    while candidates and time.monotonic() < deadline:
        # a peer serves its dense weights between rounds, not while it averages them: ask the freshest
        # peers in turn until one answers, within the download bound
        for peer in list(candidates[:3]):
            served = transport.fetch(peer, spec.name, max(1.0, deadline - time.monotonic()))
            got = None if served is None else served_dense(spec, served.meta, served.tensors, len(like))
            if not _valid(got, like):
                continue
            step = served.meta.get("step")
            why = views.doubt(DENSE, peer, got, step if type(step) is int else None)
            if why:
                refused.append(f"the dense weights of {peer[-8:]}: {why}")
                candidates.remove(peer)
                continue
            overwrite(like, got)
            ref = served.meta.get("ref")
            if isinstance(ref, str) and 0 < len(ref) <= MAX_REFERENCE:
                return True, (ref, [t.detach().clone() for t in got])
            return True, None
        time.sleep(RETRY_S)
    return False, None


def _take_experts(transport, run_id, model, peers, views, timeout, refusals) -> dict[int, int]:
    """Each expert from the freshest holder whose copy passes, asked one holder at a time (each serves all
    its experts in one request). Returns {expert: the step of the copy taken}."""
    per_expert, taken = len(expert_tensors(model, 0)), {}
    for peer in sorted(peers, key=lambda p: -peers[p].step):
        wanted = set(peers[peer].experts) - set(taken)
        if not wanted:
            continue
        served = transport.fetch(peer, f"{run_id}_experts", timeout)
        # a live holder's copy is the expert as it is now, whatever we held (its steps count its own training)
        taken |= _take_served(served, wanted, peer, model, views, {}, per_expert, refusals)
    return taken


def _take_copies(
    transport, run_id, model, by_step, views, missing, held, timeout, refusals
) -> dict[int, int]:
    """The experts that no live holder gave us, from the newest copy any peer holds (``CopyServer``): the
    freshest first, the next freshest where one is refused."""
    if not missing:
        return {}
    name, per_expert, taken, tried = f"{run_id}_copies", len(expert_tensors(model, 0)), {}, set()
    offered = {
        p: {item: step for item, (step, _) in served_steps(meta).items()}
        for p, meta in gather_metadata(transport, name, by_step, min(timeout, PRINTS_S)).items()
    }
    for _ in range(3):
        best: dict[str, set[int]] = {}
        for e in set(missing) - set(taken):
            steps = [(st[expert_item(e)], p) for p, st in offered.items() if expert_item(e) in st]
            steps = [(s, p) for s, p in steps if s > max(0, held.get(e, 0)) and (e, p) not in tried]
            if steps:
                best.setdefault(max(steps)[1], set()).add(e)
        if not best:
            break
        for peer, wanted in best.items():
            tried |= {(e, peer) for e in wanted}
            served = transport.fetch(peer, name, timeout)
            taken |= _take_served(served, wanted, peer, model, views, held, per_expert, refusals)
    return taken


def _take_served(served, wanted, peer, model, views, held, per_expert, refusals) -> dict[int, int]:
    """Overwrite our copies of ``wanted`` with what ``peer`` served, where valid, plausible (prints) and newer
    than what we hold. Returns {expert: step} of those taken; ``refusals``: (why, {expert: peers refused})."""
    if served is None:
        return {}
    items, steps, taken = served_items(served.meta, served.tensors, per_expert), served_steps(served.meta), {}
    for e in sorted(wanted):
        got, like = items.get(expert_item(e)), expert_tensors(model, e)
        step = steps.get(expert_item(e), (0, False))[0]
        if not _valid(got, like) or step <= held.get(e, -1):
            continue
        why = views.doubt(expert_item(e), peer, got, step)
        if why:
            refusals[0].append(f"expert{e} from {peer[-8:]}: {why}")
            refusals[1].setdefault(e, set()).add(peer)
            continue
        overwrite(like, [t.float() for t in got])
        taken[e] = step
    return taken
