"""A round's downloads of non-local experts, run while its groups average.

    fetch = RoundDownloads.start(ctx.downloads, holders, plan.frozen, plan.step, deadline, plan.copy_steps)
    ...                                             # the groups' all-reduce and checks meanwhile
    got, rejected, failures = fetch.wait()          # by the round's deadline

The copies a peer downloads do not depend on its own groups' results (a holder serves what its own round
gives it), so they need not wait for them: started with the round, the download phase is no longer added to
the all-reduce's time, and a round takes the longer of the two instead of their sum. The thread ends by the
deadline that ``ExpertDownloads.fetch`` keeps; the model's copies it reads do not change during a round.
With ``sync.downloads_after_matchmaking`` they begin behind a ``Gate`` instead: once the round's groups have
their members (measured at the wide WAN shape: matchmaking shorter, the all-reduce longer by about as much).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch

from swarm.net.expert_download import ExpertDownloads
from swarm.net.expert_tensors import on_this_stream
from swarm.net.membership import MembershipView

JOIN_MARGIN_S = 5.0  # past the deadline: a fetch that overran is given up (every wait inside has a bound)


class RoundDownloads:
    """See the module docstring."""

    def __init__(self, downloads: ExpertDownloads, deadline: float) -> None:
        self.downloads, self.deadline = downloads, deadline
        self._result: tuple[dict[int, list[torch.Tensor]], list[str], list[str]] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.steps: dict[int, int] = {}  # of the copies fetched: the step each is from
        self.began_at: float | None = None  # monotonic: when the fetch began (past the gate, if any)
        self.ended_at: float | None = None  # monotonic: when it ended
        self.waited_s = 0.0  # the longest a holder's copy was waited for to be fresh (``ExpertDownloads``)

    @classmethod
    def start(
        cls,
        downloads: ExpertDownloads,
        holders: Mapping[int, Sequence[tuple[str, int]]],
        mine: Mapping[int, list[torch.Tensor]],
        step: int,
        deadline: float,
        held: Mapping[int, int] | None = None,
        after: Gate | None = None,
        lagged: threading.Event | None = None,
        stopped: Callable[[str], bool] | None = None,
        patience_end: float | None = None,
    ) -> RoundDownloads:
        """``held``: the step of each copy we hold (``ExpertDownloads.fetch``). ``after``: begin once it
        opens (the round's groups have their members), so that the downloads do not hold up matchmaking's
        messages on a narrow link. ``lagged``: any copy newer than ours will do, until it is set (our
        groups are done): ``sync.lagged_refresh``, holders serve their last round's copies from its start.
        ``stopped``: whether a holder has stopped training (``stopped_training``). ``patience_end``
        (monotonic): how long a holder behind us is waited for at most (``ExpertDownloads.fetch``)."""
        self = cls(downloads, deadline)
        fetch = partial(
            downloads.fetch, holders, mine, step, False, deadline, held, lagged, stopped, patience_end
        )
        # on the round's stream: the copies of ours it reads are on the GPU of a GPU peer (``on_this_stream``)
        self._thread = threading.Thread(
            target=on_this_stream(self._run), args=(fetch, after), name="swarm-round-downloads", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, fetch: Callable[[], tuple], after: Gate | None) -> None:
        try:
            if after is not None:
                after.wait()
            self.began_at = time.monotonic()
            self._result = fetch()
            self.steps, self.waited_s = dict(self.downloads.steps), self.downloads.waited_s
            self.ended_at = time.monotonic()
        except Exception as e:  # reported by wait(): a download must not end the round's thread
            self._error = e

    def wait(self) -> tuple[dict[int, list[torch.Tensor]], list[str], list[str]]:
        """(copies, rejected, failures), once the fetch has ended (at most the deadline plus a margin)."""
        self._thread.join(timeout=max(0.0, self.deadline - time.monotonic()) + JOIN_MARGIN_S)
        if self._result is not None:
            return self._result
        why = (
            f"{type(self._error).__name__}: {self._error}"
            if self._error
            else "still running past the deadline"
        )
        return {}, [], [f"downloads: {why}"[:200]]


class Gate:
    """Opens when ``is_open()`` says so, or at ``not_after`` (monotonic) whatever it says.

    gate = Gate(lambda: all(group.formed(h) for group, h in started), not_after=t0 + matchmaking_s)
    """

    def __init__(self, is_open: Callable[[], bool], not_after: float, poll: float = 0.05) -> None:
        self.is_open, self.not_after, self.poll = is_open, not_after, poll
        self.opened_at: float | None = None

    def wait(self) -> None:
        while time.monotonic() < self.not_after and not self._open():
            time.sleep(min(self.poll, max(0.0, self.not_after - time.monotonic())))
        self.opened_at = time.monotonic()

    def _open(self) -> bool:
        try:
            return self.is_open()
        except Exception:  # a group whose state cannot be read holds nothing up
            return True


def stopped_training(view_now: Callable[[], MembershipView] | None) -> Callable[[str], bool]:
    """Whether a peer has stopped training, as the heartbeats seen now say: it is in its last round or done
    (``take_last_round``), or gone from view. Such a holder serves no fresher copy before its last round,
    and that round waits for ours: near a shared stop, a download that waited for it held our round past
    the others' last round (real swarm, 12 s)."""
    if view_now is None:
        return lambda peer: False

    def stopped(peer: str) -> bool:
        beat = view_now().peers.get(peer)
        return beat is None or beat.state in ("finishing", "done")

    return stopped
