"""Groups that meet their members before a round's slot (``sync.prematch_s``).

    early = Prematch.begin(ctx, view, slot, index, step, weights, counted, groups, alone, at)  # training thread
    ...                                                    # training goes on; the groups form meanwhile
    plan = RoundPlan(..., weights=early.weights, groups=early.groups, prematched=early.handles)  # at the slot
    early.cancel()                                         # or, when no round starts at that slot

With rounds on the wall clock, every peer knows when the next round begins. Matchmaking at the slot crosses
links that the round's downloads are already filling (on the H100 machine, int8 rounds' matchmaking took
0.35 s, median, and 0.9 to 1.9 s when the downloads began first). Met a little earlier, while the links are
idle between rounds, a group only waits for the trigger: at the slot each member writes its payload and its
all-reduce begins (hivemind's ``require_trigger``).

What members gather when they meet (``RoundInfo``) is fixed at that moment: its weights count the tokens
up to then (the window of every peer shifted alike), its step is that of the meeting, and its reference must
still be ours at the slot; a group whose reference changed meanwhile is cancelled and started as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.net.group_layout import GroupSpec, expected_members, is_dense
from swarm.net.round_checks import our_info
from swarm.net.transport import Group

if TYPE_CHECKING:
    from swarm.net.membership import MembershipView
    from swarm.net.round import RoundContext


@dataclass(frozen=True)
class Prematched:
    """One group met early: the handle ``Group.trigger`` takes, and the reference its info named."""

    handle: Any
    reference: str


@dataclass(frozen=True)
class Prematch:
    """The groups met early for the round of wall-clock slot ``slot`` (see the module docstring)."""

    slot: int
    index: int  # the round's number (``RoundPlan.index``)
    weights: Mapping[str, float]
    counted: tuple[int, Any]  # the tokens the weights count: dense, and per expert (a tensor)
    groups: Sequence[tuple[GroupSpec, Group]]
    handles: Mapping[str, Prematched]  # group name -> its early meeting

    @classmethod
    def begin(
        cls,
        ctx: RoundContext,
        view: MembershipView,
        slot: int,
        index: int,
        step: int,
        weights: Mapping[str, float],
        counted: tuple[int, Any],
        groups: Sequence[tuple[GroupSpec, Group]],
        alone: bool,
        scheduled: float,
    ) -> Prematch:
        """Look for every group's members now, for an all-reduce at ``scheduled`` (wall time). A group that
        cannot be met early (an error here) is started at the slot as usual."""
        handles = {}
        for spec, group in groups:
            if alone and is_dense(spec):
                continue
            reference = ctx.payloads.reference_id(spec)
            info = our_info(ctx, spec, view, step, index, False, weights, reference)
            try:
                handle = group.prematch(
                    info.to_msg(), scheduled, ctx.timing.matchmaking_left(slot, scheduled),
                    expected_members(spec, view, ctx.me),
                )  # fmt: skip
            except Exception:
                continue
            handles[spec.name] = Prematched(handle, reference)
        return cls(slot, index, dict(weights), counted, list(groups), handles)

    def cancel(self) -> None:
        """No round starts at this slot: every group met early is left."""
        for spec, group in self.groups:
            if spec.name in self.handles:
                leave(group, self.handles[spec.name])


def leave(group: Group, early: Prematched) -> None:
    """Give up a group met early that will not be triggered (already triggered, or closed: nothing to do)."""
    try:
        group.cancel(early.handle)
    except Exception:
        pass
