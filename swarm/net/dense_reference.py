"""With a lossy codec, the dense group's members send their changes against an agreed reference (the last
result they all applied, ``round_payload``). A member that missed that result has another one, and a round
whose members' references differ is dropped by every member (``REFERENCES_DIFFER``). These take the agreed
reference from a member that serves it (each serves its reference with its dense copy, by id):

    take_reference(spec, outcome, ctx, like, deadline)    # after such a round: the one most members had
    catch_up_reference(spec, ctx, view, like, deadline)   # after our own failed round, before the next
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from swarm.net.group_layout import DENSE, GroupSpec, served_dense
from swarm.net.round_info import RoundInfo, common_reference
from swarm.net.served_prints import metadata_only
from swarm.net.transport import GroupOutcome
from swarm.sync import RejectedTensor, check_tensors

if TYPE_CHECKING:
    from swarm.net.membership import MembershipView
    from swarm.net.round import RoundContext

POLL_S = 0.5  # a member serves its copy once its own round is over: ask again after this


def take_reference(
    spec: GroupSpec, outcome: GroupOutcome, ctx: RoundContext, like: list[torch.Tensor], deadline: float
) -> str:
    """After a round whose members' references differed: the dense reference most of them had, from one
    that serves it, as ours. Returns the member it came from, or "" if none served it in time."""
    infos = {p: RoundInfo.from_msg(v, 1) for p, v in outcome.members.items()}
    common = common_reference([i for i in infos.values() if i is not None])
    peers = sorted(p for p, i in infos.items() if i is not None and i.reference == common and p != ctx.me)
    return _adopt_from(
        spec, ctx, common, peers, like, min(deadline, time.monotonic() + ctx.timing.download_s)
    )


def catch_up_reference(
    spec: GroupSpec, ctx: RoundContext, view: MembershipView, like: list[torch.Tensor], deadline: float
) -> str:
    """After our dense round failed where the others' may not have (a partial all-reduce, a result the
    majority out-voted): if most partners in view now serve another reference than ours, take it. Otherwise
    our next round's deltas are against a reference the others no longer hold, and every member drops that
    round's dense part (on 2 cores, a partial all-reduce in an int8 swarm's last ordinary round cost the
    four peers their last round's dense part). Returns the member it came from, or ""."""
    partners = sorted(view.partners(ctx.me))
    end = min(deadline, time.monotonic() + ctx.timing.download_s)
    ours = ctx.payloads.reference_id(spec)
    refs: dict[str, str] = {}
    while not reference_settled(refs, len(partners), ours) and time.monotonic() < end:
        for peer in (p for p in partners if p not in refs):
            left = max(0.1, min(ctx.timing.request_s, end - time.monotonic()))
            served = ctx.downloads.transport.fetch(peer, spec.name, left, accept=metadata_only)
            ref = served.meta.get("ref") if served is not None else None
            if isinstance(ref, str):  # a copy is served: its round is over (during one, only prints)
                refs[peer] = ref
        if not reference_settled(refs, len(partners), ours):
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))
    common, count = Counter(refs.values()).most_common(1)[0] if refs else ("", 0)
    if not common or common == ours or 2 * count <= len(partners):
        return ""
    return _adopt_from(spec, ctx, common, [p for p, r in refs.items() if r == common], like, end)


def reference_settled(refs: dict[str, str], partners: int, ours: str) -> bool:
    """Whether the partners' answers so far (``refs``: partner -> the reference it serves) decide
    ``catch_up_reference``: every partner answered, or one reference other than ``ours`` has a strict
    majority, or none can reach one however the rest answer. Waiting for the rest then changes nothing
    (on 2 cores a member of a failed group waited its whole 30 s for a partner that was in a round of its
    own, while the other two served the reference it had)."""
    others = Counter(r for r in refs.values() if r != ours)
    best = max(others.values(), default=0)
    unanswered = partners - len(refs)
    return unanswered <= 0 or 2 * best > partners or 2 * (best + unanswered) <= partners


def _adopt_from(
    spec: GroupSpec, ctx: RoundContext, ref: str, peers: Sequence[str], like: list[torch.Tensor], end: float
) -> str:
    while ref and peers and time.monotonic() < end:
        for peer in peers:  # each serves it once it is past this round's outcome too
            served = ctx.downloads.transport.fetch(peer, spec.name, max(0.5, end - time.monotonic()))
            if served is None or served.meta.get("ref") != ref:
                continue
            dense = served_dense(spec, served.meta, served.tensors, len(like))
            try:
                check_tensors(DENSE, dense or [], like, ctx.sync.max_rel_distance)
            except RejectedTensor:
                continue
            ctx.payloads.adopt(spec, ref, {DENSE: dense})
            return peer
        time.sleep(POLL_S)
    return ""
