"""A follower that a leader has accepted (or is accepting) waits a little past its own matchmaking deadline
for the leader's begin message, instead of leaving a group that the leader has already counted it in.

    keep_accepted_followers(averager._matchmaking, grace_s=request_timeout)  # in the averager's process

hivemind's leader begins its group at its declared expiration, which is never later than its followers'
(a follower asks only leaders that expire before it), and a follower re-declares its own expiration up to
its search's deadline: at the end of a search the two can be milliseconds apart. A follower whose deadline
passes before the begin message arrives (two busy cores; a leader's event loop that is late) ends its step
with "could not find a group", while the leader and the rest of the group start an all-reduce that counts
it: every other member then waits out the sender and reducer timeouts and gets a partial round (3 of 30
convergence runs on 2 cores had a member counted so, by this race or by a begin message lost with its
stream, ``stream_linger``; benchmarks/README.md). hivemind itself waits that message up to a request
timeout past the leader's expiration; only the step's deadline cuts it short. The same holds for a follower
whose join request is still awaiting the leader's reply at its deadline: a leader counts a follower as it
accepts it, before its ACCEPTED arrives. Here the search still ends at the deadline for a peer that is
neither accepted nor asking, so nothing else waits longer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

POLL_S = 0.05  # how often a follower in its grace checks that its leader still holds it


class _LongerStep:
    """The step as hivemind's ``look_for_group`` sees it: its wait for a group ends ``grace_s`` after the
    step's deadline; the search itself (``deadline``, read for the declared expirations) is unchanged."""

    def __init__(self, step: Any, grace_s: float) -> None:
        self._step, self._grace_s = step, grace_s

    def get_timeout(self) -> float:
        return self._step.get_timeout() + self._grace_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def _held_or_asking(matchmaking: Any) -> bool:
    """A leader has accepted us, or our join request is still awaiting its reply: hivemind holds
    ``lock_request_join_group`` from sending a request until the leader answers (``request_timeout`` at
    most), and a leader that accepts has counted us before its ACCEPTED arrives. (The lock is also held
    briefly while we, as a leader, answer or assemble; waiting then is harmless and bounded by the grace.)"""
    return matchmaking.was_accepted_to_group.is_set() or matchmaking.lock_request_join_group.locked()


def keep_accepted_followers(matchmaking: Any, grace_s: float) -> None:
    """Wrap ``matchmaking.look_for_group`` (hivemind's ``Matchmaking``, once): at the step's deadline a
    search ends as before unless a leader has accepted us or is answering our request, in which case it
    waits up to ``grace_s`` more for that leader to begin the group (or to let us go). Gives None when no
    group formed, as hivemind's own does."""
    if getattr(matchmaking, "keeps_accepted_followers", False):
        return
    look = matchmaking.look_for_group

    async def look_for_group(step):
        search = asyncio.ensure_future(look(_LongerStep(step, grace_s)))
        try:
            await asyncio.wait({search}, timeout=step.get_timeout())
            grace_end = time.monotonic() + grace_s
            while not search.done() and _held_or_asking(matchmaking):
                left = grace_end - time.monotonic()
                if left <= 0:
                    break
                await asyncio.wait({search}, timeout=min(POLL_S, left))
        except asyncio.CancelledError:  # our step was cancelled: so is its search
            search.cancel()
            raise
        if not search.done():
            assembled = matchmaking.assembled_group
            search.cancel()  # hivemind's own path for a cancelled step: followers are sent away
            await asyncio.wait({search})
            if assembled.done() and not assembled.cancelled():
                assembled.exception()  # the cancellation hivemind stored there: read, so never logged
        return None if search.cancelled() else search.result()

    matchmaking.look_for_group, matchmaking.keeps_accepted_followers = look_for_group, True
