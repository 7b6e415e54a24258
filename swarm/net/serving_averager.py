"""The averager behind a ``HivemindGroup``: it serves a copy apart from its buffers, to members only.

    averager = ServingAverager(buffers, dht, prefix="demo_dense", swarm_key=key, ...)  # hivemind's arguments
    meta, tensors, held_s = await fetch_copy(dht, node, peer, "demo_experts", 30.0, token)  # copy_fetch

hivemind's ``DecentralizedAverager`` plus: a copy that the host sets (``HivemindGroup.serve``) is what
downloaders get, its metadata answered alone from the averager's process (``rpc_served_metadata``); the
group size it waits for is set step by step (``expect_members``); and with a swarm key every caller shows
its member token: in its gathered info to join a group, in its request to download. With an allowlist,
only listed peers are followed as leaders. A follower that a leader has accepted waits up to a request
timeout past its deadline for the leader to begin (``follower_grace``); a join's and an all-reduce's reply
streams stay open until the caller closes them (``stream_linger``). Its part of each all-reduce is reduced
by ``rule`` with every sender weighted 1 (``ruled_allreduce``). hivemind's own ``rpc_download_state`` is
closed. A caller that saw metadata not worth a copy may ask for the copy to be sent once that changes
(``rpc_fetch_copy``, held up to ``HOLD_MAX_S``), so a downloader gets a holder's new copy the moment it is
served, not at its next poll. Nothing here unpickles what a caller sent. It never lists itself under
hivemind's ``<prefix>.all_averagers`` DHT key: downloads here ask a holder named by its heartbeat, and that
listing, stored again after every averaged tensor, cost a demo peer about 0.35 MB a round in DHT lookups.
"""

from __future__ import annotations

import asyncio
import hashlib

# hivemind tells streaming handlers by typing's alias (``hint._name``): collections.abc's is not seen
from typing import Any, AsyncIterator  # noqa: UP035

import hivemind
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from swarm.net.dht_node import as_hivemind_child
from swarm.net.failed_groups import RemembersFailedGroups, gathered_blob
from swarm.net.follower_grace import keep_accepted_followers
from swarm.net.ruled_allreduce import RuledAllReduceRunner, partial_allreduce
from swarm.net.stream_linger import lingering
from swarm.net.swarm_key import SwarmKey
from swarm.sync.robust_mean import AggregationRule

MAX_INFO_BYTES = 4096
# the longest an ask is held for a change, whatever the caller asks (each held ask is a waiting coroutine
# in the averager's process)
HOLD_MAX_S = 2.0
ANNOUNCE_PART = 8192
LAST_ROUND_BITS = "1"  # group bits of a last round's matchmaking key (ordinary rounds': none)
# a download's last message: a copy's messages all carry metadata or a tensor part, so an empty one ends it
# (a caller that does not know it ignores it as it ignores any message without a tensor part)
COPY_END = averaging_pb2.DownloadData()
# hivemind waits for a new averager with no timeout; one whose request to its DHT process (for the p2p
# daemon) goes unanswered waits forever (seen in the suite: a DHT process gone, every later group hung)
READY_S = 60.0


class AveragerStartError(RuntimeError):
    """An averager could not start: its DHT node is not running, or it was not ready in ``READY_S``."""


def _running(dht: hivemind.DHT) -> bool:
    try:
        return dht.is_alive()
    except AssertionError:  # started by another process: not ours to tell
        return True


def gathered_token(gather: bytes) -> object:
    """The member token in a join request's gathered info (what ``HivemindGroup.start`` sends), or None."""
    info = round_info(gathered_blob(gather))  # hivemind wraps our gather, itself msgpack(info)
    return info.get("member") if info is not None else None


def round_info(blob: object) -> dict | None:
    """A member's round info from the blob it gathered: a msgpack map of at most ``MAX_INFO_BYTES``, or
    None."""
    if not isinstance(blob, bytes) or len(blob) > MAX_INFO_BYTES:
        return None
    try:
        info = MSGPackSerializer.loads(blob)
    except Exception:  # a member's bytes may be anything
        return None
    return info if isinstance(info, dict) else None


class ServingAverager(RemembersFailedGroups, hivemind.DecentralizedAverager):
    """See the module docstring. ``swarm_key``: None, or the key whose members alone it serves and groups
    with; ``rule``: how its reducer aggregates (None: the mean)."""

    def __init__(
        self,
        averaged_tensors,
        dht: hivemind.DHT,
        *args,
        swarm_key: SwarmKey | None = None,
        rule: AggregationRule | None = None,
        **kwargs,
    ) -> None:
        # before the process forks: the child checks callers with the key and reduces with the rule
        self.swarm_key, self.rule = swarm_key, rule
        if not _running(dht):  # hivemind would ask it and wait for an answer forever
            raise AveragerStartError(
                f"averager {kwargs.get('prefix')}: its DHT node's process is not running"
            )
        super().__init__(averaged_tensors, dht, *args, **kwargs)

    def __del__(self) -> None:
        # refused before hivemind's __init__ ran: its __del__ would fail on the attributes that sets
        if hasattr(self, "_parent_pid"):
            super().__del__()

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs) -> None:
        # hivemind's own, with our runner (its reducer) and without auxiliary peers, which we never start
        group_id = group_info.group_id if group_id is None else group_id
        runner = RuledAllReduceRunner(
            rule=self.rule,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise ValueError("auxiliary averagers are not used")
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
        missing = partial_allreduce(runner)
        if missing:  # hivemind would report success with some parts left at our own values
            raise AllreduceException(f"partial all-reduce: {missing}")

    async def _declare_for_download_periodically(self) -> None:
        # hivemind stores this averager under ``<prefix>.all_averagers`` every ``declare_state_period`` and
        # after every averaged tensor, for ``load_state_from_peers`` to find it. Nothing here reads that key
        # (a download asks the holder a heartbeat names), and each store is a DHT traversal: at the demo
        # shape about 38 stores per peer per round, some 0.35 MB of the 8 MB a round moved (2-minute demo)
        return

    def get_current_state(self):
        lock = getattr(self, "serve_lock", None)
        if lock is None:
            return {}, [], None
        with lock:
            meta, tensors = dict(self.served[0]), self.served[1]
        if not meta:  # not serving (before the first round, or while the buffers are being averaged)
            return {}, [], None
        if tensors is None:  # an averaging group serves its buffers, which hold its last result
            with self.get_tensors() as buffers:
                tensors = [t.clone() for t in buffers]
        elif callable(tensors):  # made for this download (host tensors: hivemind's codecs need them)
            tensors = [t.detach().cpu() for t in tensors()]
        return meta, list(tensors), None

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind's own sets SIGINT ignored in *this* process, for the child to inherit, and never restores
        # it (a Ctrl+C would be lost from then on); the child sets its own signals instead (run)
        self.start()
        if not await_ready:
            return
        wait = READY_S if timeout is None else timeout
        try:
            self.wait_until_ready(wait)
        except BaseException as e:
            self.kill()  # stuck before it serves anything: nothing to shut down cleanly
            self.join(timeout=5.0)
            if isinstance(e, TimeoutError):
                raise AveragerStartError(f"averager {self.prefix}: not ready in {wait:.0f} s") from None
            raise

    def run(self) -> None:
        as_hivemind_child()
        super().run()

    def announce(self, meta: dict[str, Any]) -> None:
        """What ``rpc_served_metadata`` answers from now on (sent to the child, which answers alone).

        In parts: CPython writes a pipe message over 16 KiB as two writes, and hivemind's child reads its
        pipe without blocking, so it can take the header of such a message before its body has arrived; the
        rest of the stream is then misread and the averager's command loop dies (seen with 17 KiB of
        prints). Parts of ANNOUNCE_PART bytes are each one write."""
        blob = MSGPackSerializer.dumps(meta)
        parts = [blob[i : i + ANNOUNCE_PART] for i in range(0, len(blob), ANNOUNCE_PART)] or [b""]
        try:
            for i, part in enumerate(parts):
                self._outer_pipe.send(("_announce", [i, len(parts), part], {}))
        except (OSError, ValueError):  # shut down: nobody asks any more
            pass

    async def _announce(self, index: int, total: int, part: bytes) -> None:
        # the host's parts arrive in order (one sender, under its serve lock): the last one completes it
        self._announcing = ([] if index == 0 else getattr(self, "_announcing", [])) + [part]
        if index == total - 1:
            self._announced, self._announcing = b"".join(self._announcing), []
            changed, self._changed = self._changed_event(), asyncio.Event()
            changed.set()  # wakes the asks held for a change (``_held_in_vain``)

    def _changed_event(self) -> asyncio.Event:
        # made in the averager's own process and loop, on first use
        if getattr(self, "_changed", None) is None:
            self._changed = asyncio.Event()
        return self._changed

    def _admits(self, token: object, context: P2PContext) -> bool:
        key = self.swarm_key
        return key is None or key.admits(context.remote_id.to_base58(), token)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """A follower that asks to join must show its member token (in its gathered info)."""
        if not self._admits(gathered_token(request.gather), context):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in lingering(super().rpc_join_group(request, context)):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, with the stream held open after the last part until the member closes it."""
        async for message in lingering(super().rpc_aggregate_part(stream, context)):
            yield message

    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's own download, which shows no token: closed (``rpc_fetch_copy`` serves members)."""
        return
        yield

    async def rpc_fetch_copy(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The served copy (metadata, then tensors) for a caller whose token (``request.gather``) admits it.

        A request that names the metadata it saw (``schema_hash``: its ``metadata_digest``) and how long it
        may wait (``expiration``, seconds) is held until the metadata differs from that; held to its end
        (at most ``HOLD_MAX_S``) with nothing new served, it is answered with the metadata alone (the
        caller saw that copy, and did not want it). Its last message is ``COPY_END``, and the stream stays
        open (``lingering``) until the caller, which has it all then, closes it."""
        if not self._admits(request.gather, context):
            return
        async for message in lingering(self._served_copy(request, context)):
            yield message

    async def _served_copy(self, request: averaging_pb2.JoinRequest, context: P2PContext):
        if await self._held_in_vain(request):
            yield averaging_pb2.DownloadData(metadata=getattr(self, "_announced", b""))
        else:
            async for message in super().rpc_download_state(averaging_pb2.DownloadRequest(), context):
                yield message
        yield COPY_END

    async def rpc_served_metadata(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> averaging_pb2.DownloadData:
        """The served copy's metadata alone: a downloader polling for a fresh copy asks this, and neither
        the copy nor the host process is touched (hivemind's own download pickles the copy from the host)."""
        if not self._admits(request.gather, context):
            return averaging_pb2.DownloadData()
        return averaging_pb2.DownloadData(metadata=getattr(self, "_announced", b""))

    async def _held_in_vain(self, request: averaging_pb2.JoinRequest) -> bool:
        """Wait while what we serve is what the caller saw (``schema_hash``), up to the seconds it allows
        (``expiration``, at most ``HOLD_MAX_S``); whether it still is. A request that names nothing is not
        held."""
        changed, hold = self._changed_event(), min(request.expiration, HOLD_MAX_S)  # NaN: not held
        if not request.schema_hash or not hold > 0:
            return False
        if metadata_digest(getattr(self, "_announced", b"")) != request.schema_hash:
            return False
        try:
            await asyncio.wait_for(changed.wait(), hold)
        except asyncio.TimeoutError:
            return True
        return False

    def expect_members(self, n: int | None, last: bool = False) -> None:
        """Before a step: the group it forms may begin as soon as ``n`` members are in, and a ``last``
        round's step meets only other last rounds' (runs in the child)."""
        self._outer_pipe.send(("_expect_members", [n, last], {}))

    async def _expect_members(self, n: int | None, last: bool = False) -> None:
        # a key of its own for last rounds: under the ordinary one, a peer that reached its step limit a slot
        # before another met that one's ordinary round, and every member dropped the mixed group (the ends
        # of 2 of 5 wan.py runs on H100 peers). Set before every step: a formed group rewrites the bits
        self._matchmaking.group_key_manager.group_bits = LAST_ROUND_BITS if last else ""
        # hivemind's target_group_size, changed round by round: a leader whose followers make ``n`` begins
        # at once instead of at the end of its matchmaking window, and turns away more (``GROUP_IS_FULL``)
        self._matchmaking.target_group_size = n
        self._matchmaking.potential_leaders.target_group_size = n
        self._follow_listed_leaders_only()
        keep_accepted_followers(self._matchmaking, grace_s=self._matchmaking.request_timeout)

    def _follow_listed_leaders_only(self) -> None:
        """With an allowlist, the leaders we would ask to join are the listed peers only: an unlisted holder
        of the key can declare itself in the DHT, and a group it led would be refused by every member."""
        key, keys = self.swarm_key, self._matchmaking.group_key_manager
        if key is None or key.allowlist is None or getattr(keys, "listed_only", False):
            return
        declared = keys.get_averagers

        async def listed(*args, **kwargs):
            return [(p, t) for p, t in await declared(*args, **kwargs) if key.allows(p.to_base58())]

        keys.get_averagers, keys.listed_only = listed, True

    async def _shutdown(self, timeout):
        # hivemind leaves the averager's P2P replica open at shutdown, and its client socket file in /tmp
        # behind; close it so that a clean exit leaves nothing
        try:
            await super()._shutdown(timeout)
        finally:
            p2p = getattr(self, "_p2p", None)
            if p2p is not None:
                await p2p.shutdown()


def is_copy_end(message: averaging_pb2.DownloadData) -> bool:
    """Whether a download's message is ``COPY_END`` (no metadata, no tensor part: nothing else is empty)."""
    return not (message.metadata or message.tensor_part.dtype or message.tensor_part.buffer)


def metadata_digest(blob: bytes) -> bytes:
    """What a held request names the served metadata it saw by (``rpc_fetch_copy``)."""
    return hashlib.blake2b(blob, digest_size=16).digest()
