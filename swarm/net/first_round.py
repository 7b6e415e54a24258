"""A peer's first round on the wall clock (``sync.sync_every_s``): in which slot, and met how.

    if first_step_joins(view, me, slot_began, prematch=True): ...   # our first step starts that slot's round
    if partners_rounded(view, me): ...                             # our first round's groups meet early too

Peers that start together a second apart straddle a slot's start. Rounding a slot apart cost them: on H100
peers three rounded without the fourth, whose int8 reference then differed from theirs, and all four lost
their next dense round. Where the others' groups meet decides whether a late starter can still join them:
at the slot, a group looks for members for a while; met before it (``sync.prematch_s``), a group forms at
the slot with whoever met it. So a swarm's first round meets at its slot, and a peer whose first step comes
early in a slot joins that slot's round only where the others meet there.
"""

from __future__ import annotations

from swarm.net.membership import MembershipView


def partners_rounded(view: MembershipView, me: str) -> bool:
    """Whether a partner has taken a round: its groups then meet before each slot (with ``prematch_s``), and
    so should ours, even before our own first round (a joiner's, in a swarm that runs)."""
    return any(view.peers[p].last_round >= 1 for p in view.partners(me))


def first_step_joins(view: MembershipView, me: str, slot_began: float, prematch: bool) -> bool:
    """At our first step, early in a slot: whether a partner took its first step before that slot began (the
    heartbeat's ``first_step_at``), so that it rounds in this slot, and meets its groups at the slot (no
    partner has rounded yet, or groups do not meet early), where they still look for members. Without such a
    partner we would round alone: in a demo, the first peer to start did, and its round joined the groups
    the others met for the next slot."""
    if prematch and partners_rounded(view, me):
        return False
    firsts = (view.peers[p].first_step_at for p in view.partners(me))
    return any(at is not None and at < slot_began for at in firsts)
