"""A ``Group`` on hivemind: one DecentralizedAverager (its own process) per group name.

    group = HivemindGroup(dht, "demo_dense", like=[...])   # host fp32 buffers of the packed shapes
    handle = group.start(tensors, info, matchmaking_s=5.0)  # returns at once; the all-reduce runs in the
    outcome = group.outcome(handle, timeout=60.0)           # averager's process; GroupOutcome
    group.serve(tensors, meta)                              # a copy downloaders get (``download_state``)

Peers that use the same name are matched by hivemind into one group. Members average with equal weight
(the weights travel inside the tensors). hivemind reports success for partially averaged tensors and
trusts every sender (NOTES.md): a member whose tensors came back partly unaveraged gets a failed outcome
(``ruled_allreduce.partial_allreduce``), and the round verifies every other outcome before using it. The served copy is held
apart from the averaging buffer, so a download never sees a half-averaged tensor. With a swarm key
(``start_dht(swarm_key=...)``), every member's info carries its member token, and a group with a member
that has none is refused by every other member before its tensors are used (``ServingAverager`` already
turns such a peer away at the door).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.utils import MSGPackSerializer

from swarm.net.copy_fetch import fetch_copy
from swarm.net.dht_node import hivemind_child_signals
from swarm.net.served_prints import kept_prints
from swarm.net.serving_averager import MAX_INFO_BYTES, ServingAverager, round_info
from swarm.net.transport import GroupOutcome, is_last_round
from swarm.sync.robust_mean import AggregationRule

SHUTDOWN_S = 5.0  # each averager's own grace period (``shutdown_timeout``) before hivemind terminates it
BUFFER_LOCK_S = 2.0  # an all-reduce still holding the buffers after its timeout: give up the round
FORMED_POLL_S = 0.05
FAILED_ASK_S = 1.0  # asking our averager's process for the group of a step that failed on our side


class HivemindGroup:
    """See the module docstring. ``like``: the buffers' shapes, or None for a group that only serves (its
    copies may change shape); ``compression``: how tensors travel in the all-reduce; ``serve_compression``:
    how served copies travel (default fp16); ``rule``: how this member reduces its part of the all-reduce
    (``swarm.sync.robust_mean``; None: the mean); ``late_s``: how much later than the others a member of a
    group met early may begin its all-reduce (``Timing.late_s``). An averaging group serves its buffers
    between rounds (one host copy per group)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        name: str,
        like: Sequence[torch.Tensor] | None,
        *,
        matchmaking_time: float = 5.0,
        allreduce_timeout: float = 60.0,
        request_timeout: float = 5.0,
        late_s: float = 0.0,
        compression: CompressionBase | None = None,
        serve_compression: CompressionBase | None = None,
        rule: AggregationRule | None = None,
    ) -> None:
        self.name, self.serves_only, self.matchmaking_time = name, like is None, matchmaking_time
        self.partners_wait_s = 4 * request_timeout + late_s  # the longest a member waits for our part
        self.swarm_key, self.me = getattr(dht, "swarm_key", None), dht.peer_id.to_base58()
        with hivemind_child_signals():
            self.averager = ServingAverager(
                # always host tensors: hivemind's compression calls .numpy() and fails on CUDA tensors
                [torch.zeros(t.shape, dtype=torch.float32, device="cpu") for t in like or [torch.zeros(1)]],
                dht,
                prefix=name,
                start=True,
                min_group_size=2,
                min_matchmaking_time=matchmaking_time,
                request_timeout=request_timeout,
                allreduce_timeout=allreduce_timeout,
                # a busy peer (its CPUs training) can be seconds late with a part: a part that times out
                # leaves a partial round that every member must drop, so these waits are generous; a member
                # of a group met early starts its all-reduce when it reaches the slot, up to ``late_s``
                # after the others (a step, an evaluation): its first part is waited for that much longer
                next_chunk_timeout=2 * request_timeout,
                sender_timeout=2 * request_timeout + late_s,
                reducer_timeout=self.partners_wait_s,
                compression=compression or NoCompression(),
                state_compression=serve_compression or Float16Compression(),
                allow_state_sharing=True,
                shutdown_timeout=SHUTDOWN_S,
                swarm_key=self.swarm_key,
                rule=rule,
            )
        self.averager.serve_lock, self.averager.served = threading.Lock(), ({}, None)
        self._prints: dict[str, Any] = {}
        self._began = 0.0  # when our latest step began (wall time)

    def _set_served(self, meta: dict[str, Any], tensors: list[torch.Tensor] | None) -> None:
        with self.averager.serve_lock:
            # while nothing is served, the prints of the last copy still are (``served_prints``): a joiner
            # must not find every peer mute because each happens to be in a round
            if "prints" in meta:
                self._prints = kept_prints(meta)
            self.averager.served = (dict(meta), tensors)
            # under the lock: announcements arrive in the order of the copies
            self.averager.announce(meta if meta else self._prints)

    def serve(self, tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], meta) -> None:
        """A serving group keeps ``tensors`` as given (not copied: never edit them afterwards), or calls
        ``tensors()`` for each download; an averaging group copies them into its buffers (its packed
        layout)."""
        if self.serves_only:
            self._set_served(meta, tensors if callable(tensors) else list(tensors))
            return
        self._set_served({}, None)
        self._fill(tensors)
        self._set_served(meta, None)

    def _fill(self, tensors: Iterable[torch.Tensor]) -> None:
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=BUFFER_LOCK_S):  # a stuck all-reduce is abandoned, not awaited
            raise TimeoutError(f"{self.name}: the previous all-reduce still holds the buffers")
        try:
            for dst, src in zip(self.averager._averaged_tensors, tensors, strict=True):
                dst.copy_(src)
        finally:
            lock.release()

    def start(
        self,
        tensors: Iterable[torch.Tensor],
        info: dict[str, Any],
        matchmaking_s: float,
        scheduled: float | None = None,
        expected: int | None = None,
    ) -> StepControl:
        gather, self._began = self._gather(info), time.time()
        if scheduled is None and matchmaking_s <= self.matchmaking_time:
            # hivemind schedules a step its matchmaking time ahead and requires that within the timeout; a
            # round late in its slot looks for less (``Timing.matchmaking_left``): it forms only if complete
            scheduled = time.time() + 0.9 * matchmaking_s
        self._set_served({}, None)  # the buffers are about to change: serve nothing until the next result
        self._fill(tensors)
        # commands reach the averager's process in order: the size is set before the step looks for a group
        self._expect(expected, last=is_last_round(info))
        return self.averager.step(
            gather=gather,
            weight=1.0,
            timeout=matchmaking_s,
            scheduled_time=scheduled,  # None: now + the matchmaking time
            wait=False,
            allow_retries=False,
        )

    def prematch(
        self, info: dict[str, Any], scheduled: float, matchmaking_s: float, expected: int | None = None
    ) -> StepControl:
        # hivemind's own early matchmaking: the group forms now and its all-reduce waits for the trigger;
        # the buffers keep serving our last result until then
        gather, self._began = self._gather(info), time.time()
        self._expect(expected)
        return self.averager.step(
            gather=gather,
            weight=1.0,
            timeout=max(0.0, scheduled - time.time()) + matchmaking_s,
            scheduled_time=scheduled,
            require_trigger=True,
            wait=False,
            allow_retries=False,
        )

    def trigger(self, handle: StepControl, tensors: Iterable[torch.Tensor]) -> StepControl:
        self._set_served({}, None)
        self._fill(tensors)
        handle.allow_allreduce()
        return handle

    def cancel(self, handle: StepControl) -> None:
        handle.cancel()

    def _expect(self, expected: int | None, last: bool = False) -> None:
        # below two members (our view sees nobody else) no size is set: the group forms with whoever comes
        self.averager.expect_members(expected if expected is None or expected >= 2 else None, last)

    def _gather(self, info: dict[str, Any]) -> bytes:
        if self.swarm_key is not None:
            info = info | {"member": self.swarm_key.member_token(self.me)}
        gather = MSGPackSerializer.dumps(info)
        if len(gather) > MAX_INFO_BYTES:
            raise ValueError("round info too large")
        return gather

    def formed(self, handle: StepControl) -> bool:
        return handle.done() or has_members(handle)

    def outcome(self, handle: StepControl, timeout: float) -> GroupOutcome:
        gathered, formed_at, why = await_step(handle, timeout, untaken_s=self.partners_wait_s)
        if why:
            return GroupOutcome(False, why, members=self._failed_members())
        if not gathered:
            return GroupOutcome(False, "no group formed")
        members, why = gathered_members({p.to_base58(): blob for p, blob in gathered.items()}, self.swarm_key)
        if why:
            return GroupOutcome(False, why)
        lock = self.averager.lock_averaged_tensors
        if not lock.acquire(timeout=BUFFER_LOCK_S):
            return GroupOutcome(False, "averaged tensors stayed locked")
        try:
            tensors = [t.clone() for t in self.averager._averaged_tensors]
        finally:
            lock.release()
        return GroupOutcome(True, tensors=tensors, members=members, formed_at=formed_at)

    def _failed_members(self) -> dict[str, dict[str, Any]]:
        """The members' infos of our step's group if it formed and our side of its all-reduce failed (they
        need not wait for our digest: ``round_checks`` tells them), else {}."""
        try:
            failed = self.averager.last_failed_group(timeout=FAILED_ASK_S)
        except Exception:  # the averager's process is busy or gone: the members wait, as they used to
            return {}
        if failed is None or failed[0] < self._began:  # none, or an earlier step's
            return {}
        members, why = gathered_members(failed[1], self.swarm_key)
        return {} if why else members

    def close(self) -> None:
        try:
            self.averager.shutdown()
        except Exception:
            pass


def gathered_members(gathered: dict[str, bytes], swarm_key) -> tuple[dict[str, dict[str, Any]], str]:
    """({peer id: its round info}, "") from the blobs a group's members gathered, or ({}, why not): a blob
    that is not a msgpack map of at most ``MAX_INFO_BYTES``, or a member without ``swarm_key``'s token."""
    members = {}
    for peer, blob in gathered.items():
        info = round_info(blob)
        if info is None:
            return {}, f"malformed round info from {peer}"
        if swarm_key is not None and not swarm_key.admits(peer, info.get("member")):
            return {}, f"a member without the swarm key: {peer[-8:]}"
        members[peer] = info
    return members, ""


def has_members(handle: StepControl) -> bool:
    """Whether hivemind's step has found its group (it is past matchmaking)."""
    return handle.stage.value >= AveragingStage.AWAITING_TRIGGER.value


def await_step(
    handle: StepControl, timeout: float, poll: float = FORMED_POLL_S, untaken_s: float | None = None
) -> tuple[Any, float, str]:
    """(what the step gathered, when its group formed (monotonic), "") or (None, 0.0, why it failed),
    within ``timeout``. Waits in short polls to see when the group formed (the rest is the all-reduce).
    A triggered step (``allow_allreduce`` called before this wait) whose group formed but whose averager
    still waits for the trigger ``untaken_s`` later is given up: its members have left it out by then."""
    end, formed_at, untaken_since = time.monotonic() + timeout, None, None
    while True:
        try:
            gathered = handle.result(timeout=max(0.0, min(poll, end - time.monotonic())))
            return gathered, formed_at or time.monotonic(), ""
        except FutureTimeout:
            if handle.done():  # a timeout inside hivemind, or the step ended just after our wait did: a
                try:  # success taken for a failure would leave the partners waiting for our digest in vain
                    return handle.result(timeout=0), formed_at or time.monotonic(), ""
                except Exception as e:
                    return None, 0.0, f"{type(e).__name__}: {e}"[:200]
            if formed_at is None and has_members(handle):
                formed_at = time.monotonic()
            if handle.stage != AveragingStage.AWAITING_TRIGGER:
                untaken_since = None
            elif untaken_since is None:
                untaken_since = time.monotonic()
            elif untaken_s is not None and time.monotonic() - untaken_since > untaken_s:
                # seen once on 2 busy cores: the trigger never reached the averager's process, which then
                # held the round (and every later one) for the whole timeout while its members went on
                handle.cancel()
                return None, 0.0, f"TriggerNotTaken: the all-reduce did not begin within {untaken_s:.0f} s"
            if time.monotonic() < end:
                continue
            handle.cancel()
            return None, 0.0, f"TimeoutError: no result within {timeout:.1f} s"
        except Exception as e:  # cancelled, allreduce failure
            handle.cancel()
            return None, 0.0, f"{type(e).__name__}: {e}"[:200]


def close_groups(groups: Sequence[Any], timeout: float = SHUTDOWN_S + 2.0) -> None:
    """Close groups side by side, so that leaving takes one grace period, not one per group."""
    threads = [threading.Thread(target=g.close, name="swarm-group-close", daemon=True) for g in groups]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


def download_state(
    dht: hivemind.DHT,
    peer: str,
    prefix: str,
    timeout: float = 30.0,
    accept=None,
    max_bytes: int | None = None,
    hold_s: float = 0.0,
):
    """(metadata, tensors, seconds held) of group ``prefix`` as served by ``peer``, or None on any failure
    or timeout; ``accept(metadata)`` (picklable) false: (metadata, [], 0.0), after up to ``hold_s`` of
    waiting for the holder to serve something it takes (``fetch_copy``)."""
    try:
        key = getattr(dht, "swarm_key", None)
        token = key.member_token(dht.peer_id.to_base58()) if key is not None else b""
        fn = functools.partial(
            fetch_copy,
            peer=peer,
            prefix=prefix,
            timeout=timeout,
            token=token,
            accept=accept,
            max_bytes=max_bytes,
            hold_s=hold_s,
        )
        return dht.run_coroutine(fn, return_future=True).result(timeout=timeout + 5)
    except Exception:
        return None
