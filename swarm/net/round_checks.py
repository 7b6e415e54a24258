"""Whether a group's outcome may be used: ``check_outcome`` (the members' round infos and the weights that came
back; our digest published), then ``confirm_outcome`` (every member's digest agrees, the tensors pass
``check_tensors``). ``run_round`` calls them for each group it started. A group that formed and failed on our
side gets ``tell_failed``: its members learn it at once instead of waiting for our digest.

    spent = {}                                       # seconds per sub-step, summed (``RoundRecord.check_seconds``)
    size, why, published = check_outcome(spec, outcome, last, ctx, local, payload, deadline, spent)
    averages, why = confirm_outcome(spec, outcome, ctx, local, payload, published, deadline, spent)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from swarm.net.group_layout import DENSE, GroupSpec, expected_members, is_dense, reference_quorum
from swarm.net.round_consensus import FAILED_DIGEST, abs_sums, await_digests, digest, group_key
from swarm.net.round_info import (
    REFERENCES_DIFFER,
    ROBUST_PAIR,
    WEIGHT_TOLERANCE,
    RoundInfo,
    common_reference,
    reference_moves,
)
from swarm.net.round_payload import SentPayload
from swarm.net.transport import GroupOutcome
from swarm.sync import RejectedTensor, check_tensors

TELL_FAILED_S = 2.0  # at most, for telling a failed group's members (a message each, or a DHT store)

if TYPE_CHECKING:
    from swarm.net.membership import MembershipView
    from swarm.net.round import RoundContext


def _gone(ctx: RoundContext, rounds: Mapping[str, int]) -> Callable[[str], bool]:
    """Whether a member's digest will not come: it has published no heartbeat for a record's lifetime (it
    died or lost the network: a live peer publishes every period), or its heartbeat says it has ended the
    round (``rounds``: each member's round index, from its info) in which it took this group. A member
    publishes its digest before its round ends, so one that ended it without had this group fail on its
    side: hivemind's matchmaking can leave a member out of a group that the others formed."""
    if ctx.view_now is None:
        return lambda peer: False

    def gone(peer: str) -> bool:
        view = ctx.view_now()
        if view.silent_for(peer) > ctx.timing.record_ttl_s:
            return True
        beat = view.peers.get(peer)
        return beat is not None and peer in rounds and beat.last_round >= rounds[peer]

    return gone


def _member_rounds(outcome: GroupOutcome, n_items: int) -> dict[str, int]:
    """Each member's round index, from the info it sent (``check_outcome`` parsed every one already)."""
    infos = {peer: RoundInfo.from_msg(msg, n_items) for peer, msg in outcome.members.items()}
    return {peer: info.round for peer, info in infos.items() if info is not None}


def add_time(spent: dict[str, float] | None, step: str, since: float) -> float:
    """Add the seconds since ``since`` to ``spent[step]``; returns now."""
    now = time.monotonic()
    if spent is not None:
        spent[step] = round(spent.get(step, 0.0) + now - since, 3)
    return now


def weighted(ctx: RoundContext) -> bool:
    """Whether members are weighted by their tokens (the plain mean) or all equally (a robust rule)."""
    return ctx.sync.aggregation == "mean"


def our_info(
    ctx: RoundContext, spec: GroupSpec, view: MembershipView, step: int, index: int, last: bool,
    weights: Mapping[str, float], reference: str,
) -> RoundInfo:  # fmt: skip
    """What we tell the other members of ``spec``'s group this round (a robust rule weights every member
    alike: then a weight is only what a member says of itself)."""
    ws = tuple(weights[i] if weighted(ctx) else 1.0 for i in spec.items)
    quorum, codec = reference_quorum(spec, view, ctx.me), ctx.payloads.codec_for(spec).name
    return RoundInfo(
        step, index, last, ws, reference, ctx.sync.aggregation, ctx.sync.digests, quorum,
        ctx.payloads.held(spec), codec, expected_members(spec, view, ctx.me),
    )  # fmt: skip


def check_outcome(
    spec: GroupSpec,
    outcome: GroupOutcome,
    last: bool,
    ctx: RoundContext,
    local: Mapping[str, list[torch.Tensor]],
    payload: SentPayload | None,
    deadline: float,
    spent: dict[str, float] | None = None,
) -> tuple[int, str, tuple[str, list[float]] | None]:
    """(group size, why the outcome is refused or "", (digest key, our digest)). A sound outcome's digest
    is published (``spent``: seconds added to "digest", computing it, and "publish", storing it)."""
    if not outcome.ok:
        if outcome.members:  # a group that formed and failed on our side: its members need not wait for us
            tell_failed(spec, outcome, ctx, deadline)
        return 1, outcome.reason, None
    size = len(outcome.members)
    infos = [RoundInfo.from_msg(v, len(spec.items)) for v in outcome.members.values()]
    if any(i is None for i in infos):
        return size, "a member sent a malformed or implausible round info", None
    if any(i.rule != ctx.sync.aggregation for i in infos):
        return size, "a member aggregates by another rule (sync.aggregation)", None
    if any(i.digests != ctx.sync.digests for i in infos):  # their digests would never reach each other
        return size, "a member exchanges digests another way (sync.digests)", None
    if any(i.codec != ctx.payloads.codec_for(spec).name for i in infos):  # tolerances and errors differ
        return size, "a member's tensors travel in another codec (sync.codec, sync.dense_codec)", None
    if any(i.last != last for i in infos):
        # a last round must not mix with an ordinary one: the peer in the ordinary round trains on and we
        # would end holding a copy it never had (every member sees the same infos and drops it)
        return size, "a member was in another kind of round (last vs ordinary)", None
    if any(i.reference != payload.reference for i in infos):
        # deltas against different states average to nothing meaningful: every member drops the round. In a
        # dense group the most common reference stays (the others take it: dense_reference); an expert group
        # serves none to take, so all its members forget theirs and start a common one (round_payload)
        if payload.reference != common_reference(infos) or spec.items != (DENSE,):
            ctx.payloads.forget(spec.name)
        return size, REFERENCES_DIFFER, None
    if unbounded_pair(spec, infos, ctx):
        return size, ROBUST_PAIR, None
    tensors = outcome.tensors
    if len(tensors) != sum(len(local[i]) for i in spec.items) + 1:
        return size, "the averaged tensors do not match the group's items", None
    claimed = [math.fsum(w) / size for w in zip(*(i.weights for i in infos), strict=True)]
    if not weighted(ctx):  # whatever a member claimed, the rule weighted everyone 1
        claimed = [1.0] * len(spec.items)
    for w_got, w_claimed in zip(tensors[-1].tolist(), claimed, strict=True):
        if not abs(w_got - w_claimed) <= WEIGHT_TOLERANCE * w_claimed + 1e-6:
            return size, "the weights averaged differ from those the members reported", None
    key = group_key(ctx.run_id, spec.name, dict(outcome.members))
    timeout = max(0.5, min(10.0, deadline - time.monotonic()))
    t = time.monotonic()
    mine = digest(tensors)
    t = add_time(spent, "digest", t)
    published = ctx.digests.publish(key, mine, list(outcome.members), timeout)
    add_time(spent, "publish", t)
    if not published:
        return size, "could not publish digest", None
    return size, "", (key, mine)


def unbounded_pair(spec: GroupSpec, infos: list[RoundInfo], ctx: RoundContext) -> bool:
    """A dense group of two under a robust rule while a member sees three or more peers: the rule cannot tell
    which of two members is the rogue (each is the other's whole majority), so a rogue that paired with us
    would move our weights as the plain mean lets it; the round is dropped instead (an attack run had the
    honest peers' loss at 9.45 against 5.0 when groups split into pairs). Judged by every member's view, so
    that both drop it: by its own view alone, in a demo's first round, one member of a pair dropped it and
    the other applied it. Expert groups of two holders (r = 2) have no third member to ask: they are kept,
    with the checks every result passes."""
    return not weighted(ctx) and is_dense(spec) and len(infos) == 2 and max(i.in_view for i in infos) >= 3


def tell_failed(spec: GroupSpec, outcome: GroupOutcome, ctx: RoundContext, deadline: float) -> bool:
    """Send the group's members ``FAILED_DIGEST`` under the group's digest key: they drop the round, or a
    majority applies it, at once, instead of waiting for our digest until their deadline (see
    ``failed_groups``). Whether it was sent."""
    key = group_key(ctx.run_id, spec.name, dict(outcome.members))
    timeout = max(0.5, min(TELL_FAILED_S, deadline - time.monotonic()))
    return ctx.digests.publish(key, FAILED_DIGEST, list(outcome.members), timeout)


def confirm_outcome(
    spec: GroupSpec,
    outcome: GroupOutcome,
    ctx: RoundContext,
    local: Mapping[str, list[torch.Tensor]],
    payload: SentPayload,
    published: tuple[str, list[float]],
    deadline: float,
    spent: dict[str, float] | None = None,
) -> tuple[dict[str, list[torch.Tensor]] | None, str]:
    """(averaged tensors per item, "") once every member's digest agrees and the tensors pass the checks,
    else (None, why not). ``spent``: seconds added to "await" (the others' digests) and "verify"."""
    t = time.monotonic()
    # until the round's own deadline: a member may come to this group only after waiting on another one
    timeout = max(0.5, deadline - time.monotonic())
    key, mine = published
    tolerance = ctx.payloads.codec_for(spec).tolerance
    floor = None if isinstance(payload.tensors, Iterator) else abs_sums(payload.tensors)
    ok, why = await_digests(
        ctx.digests, key, ctx.me, list(outcome.members), mine, timeout, tolerance, floor,
        grace=ctx.timing.quorum_grace_s, gone=_gone(ctx, _member_rounds(outcome, len(spec.items))),
    )  # fmt: skip
    t = add_time(spent, "await", t)
    if not ok:
        return None, why
    sizes = {i: len(local[i]) for i in spec.items}
    averages, _ = ctx.payloads.decode(spec, payload, outcome.tensors, sizes)
    try:
        for item in spec.items:
            check_tensors(item, averages[item], local[item], ctx.sync.max_rel_distance)
    except RejectedTensor as e:
        add_time(spent, "verify", t)
        return None, str(e)
    infos = [RoundInfo.from_msg(v, len(spec.items)) for v in outcome.members.values()]  # check_outcome's
    moves = reference_moves(infos, len(outcome.members))
    ctx.payloads.commit(spec, payload, averages, key, moves, ctx.core)
    add_time(spent, "verify", t)
    return averages, ""
