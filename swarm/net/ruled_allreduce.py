"""hivemind's butterfly all-reduce with our aggregation rule in each reducer, and every sender weighted 1.

In hivemind, the member that reduces a part of the vector receives that part from every member and returns
the weighted mean, with the weight each sender states in its own messages, unchecked: a member that said
1e7 took over 99% of the average. Here a reducer ignores stated weights (ours travel inside the tensors and
are checked by every member, ``round``), and with a rule (``swarm.sync.robust_mean``) it keeps every
sender's part and returns the rule's aggregate instead of the mean. A part is hivemind's unit of streaming
(at most 512 KiB on the wire), so the rule bounds each rogue contribution part by part.

Used by ``ServingAverager``; nothing else about the all-reduce changes (timeouts, bans, compression), except
that a member closes each reducer's reply stream once all its parts have come (``stream_linger``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer

from swarm.net.stream_linger import ClosingStub
from swarm.sync.robust_mean import AggregationRule

log = logging.getLogger(__name__)


class RuledPartReducer(TensorPartReducer):
    """hivemind's reducer with weight 1 for every sender and, given a ``rule``, that rule's aggregate."""

    def __init__(
        self, part_shapes: Sequence[torch.Size], num_senders: int, rule: AggregationRule | None
    ) -> None:
        self.rule, self._parts = rule, {}  # part index -> {sender index: its part}
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if (
            self.rule is not None
            and 0 <= sender_index < self.num_senders
            and 0 <= part_index < self.num_parts
        ):
            self._parts.setdefault(part_index, {})[sender_index] = tensor_part
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=1.0)

    def check_current_part_finished(self) -> None:
        index = self.current_part_index
        done = 0 < self.current_part_accumulated_from == self.num_current_senders
        if self.rule is not None and done:
            got = self._parts.pop(index, {})
            # a sender that failed before this part is not in the mean either (hivemind's rule for bans)
            parts = [t for s, t in sorted(got.items()) if index < self.sender_failed_after[s]]
            if parts:  # the base divides by the number of senders (each weighted 1)
                self.accumulator = self.rule(torch.stack(parts)) * self.denominator
        super().check_current_part_finished()


class RuledAllReduceRunner(AllReduceRunner):
    """``AllReduceRunner`` whose reducer is a ``RuledPartReducer``, and which logs why each share failed,
    keeping the failed reducers' reasons in ``reducer_failures`` (hivemind logs the exceptions only at debug
    level, and the debug log's own cost changed the timing of the 2-core runs enough that none failed with
    it on)."""

    def __init__(self, *, rule: AggregationRule | None = None, **kwargs) -> None:
        self.reducer_failures: list[str] = []  # each leaves part of our tensors at our own values
        super().__init__(**kwargs)
        # the base's reducer is never used: finished now, it does not report 0% received when collected
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = RuledPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids), rule
        )

    def _get_peer_stub(self, peer):
        # we close each reducer's reply stream once every part has come, so that its handler, which holds
        # its end open until then (``stream_linger``), never closes first under a part in flight
        parts = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)]
        return ClosingStub(super()._get_peer_stub(peer), parts)

    async def _communicate_with_peer(self, peer_id) -> None:
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as e:  # the base has left our share at that reducer at our own values
            why = f"reducer {_short(peer_id)} failed: {_short_ids(repr(e), peer_id)}"
            self.reducer_failures.append(why)
            self._log(why)
            raise

    async def _ban_sender(self, peer_id) -> None:
        # the base calls this inside the handler of the error that made it give up on the sender (or of
        # the sender-start timeout), so that error is the one being handled here
        if peer_id not in self.banned_senders:
            why = repr(sys.exc_info()[1])
            self._log(f"sender {_short(peer_id)} left out: {_short_ids(why, peer_id)}")
        await super()._ban_sender(peer_id)

    def _log(self, why: str) -> None:
        # logged at once: a sender is often left out after our own share is done
        log.warning(f"{self._prefix} all-reduce {self.group_id.hex()[:8]}: {why}")


def _short(peer_id) -> str:
    return str(peer_id)[-8:]


def _short_ids(text: str, peer_id) -> str:
    # the round's reasons are cut at 200 characters: a 46-character peer id would push the cause out
    return text.replace(str(peer_id), _short(peer_id))


def partial_allreduce(runner: RuledAllReduceRunner) -> str:
    """Why the all-reduce that ``runner`` ran left this member's tensors partly at its own values ('' if it
    did not): a member that was to reduce a share of them failed. hivemind reports that as success, and no
    other member holds those values. (A sender that failed at a reducer is left out of that reducer's share
    for every member alike: a result they still agree on, which the round's digests judge.)"""
    container = runner.tensor_part_container
    if not container.failed_size:
        return ""
    why = runner.reducer_failures
    return f"{container.failed_size} of {container.total_size} values not averaged" + (
        f" ({'; '.join(why)})" if why else ""
    )
