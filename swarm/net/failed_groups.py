"""The group of a hivemind all-reduce that failed on our side, so that we can tell its other members at once.

    class ServingAverager(RemembersFailedGroups, hivemind.DecentralizedAverager): ...
    averager.last_failed_group(timeout=1.0)    # (wall time, {peer id: its gathered info}) or None

A member whose part of an all-reduce failed (a sender it waited for timed out: hivemind raises, with the
group's infos gone) used to end its round without a word. Its partners, whose side went through, then
waited for its round digest until their round's deadline (30 s and more) or until its heartbeat said it had
left that round, which it did only after waiting for them in turn (``catch_up_reference``). On links with
latency, the first rounds of new peers failed so and took 40 to 50 s. With the group's infos, the failed
member computes the group's digest key and sends a digest that agrees with nothing (``round_checks``).

hivemind's ``_aggregate_with_group`` runs in the averager's process and re-raises a failure without the
group: this mixin keeps the group's gathered infos there, and ``last_failed_group`` asks for them over the
averager's command pipe (the way hivemind's own ``get_group_bits`` does).
"""

from __future__ import annotations

import time

from hivemind.utils import MSGPackSerializer
from hivemind.utils.mpfuture import MPFuture


class RemembersFailedGroups:
    """A mixin for a ``hivemind.DecentralizedAverager`` (see the module docstring)."""

    _failed_group: tuple[float, dict[str, bytes]] | None = None

    async def _aggregate_with_group(self, group_info, *args, **kwargs):
        try:
            return await super()._aggregate_with_group(group_info, *args, **kwargs)
        except BaseException:
            self._failed_group = (time.time(), gathered_infos(group_info.peer_ids, group_info.gathered))
            raise

    def last_failed_group(self, timeout: float) -> tuple[float, dict[str, bytes]] | None:
        """When our side of an all-reduce last failed (wall time) and each member's gathered info then (the
        msgpack blob it sent with its join request), or None if none has failed."""
        future = MPFuture()
        self._outer_pipe.send(("_last_failed_group", [], dict(future=future)))
        return future.result(timeout=timeout)

    async def _last_failed_group(self, future: MPFuture) -> None:
        future.set_result(self._failed_group)


def gathered_infos(peer_ids, gathered) -> dict[str, bytes]:
    """{peer id: the info blob it gathered} from hivemind's group; an entry that is not as ``gathered_blob``
    reads it is left out (a member's bytes may be anything)."""
    blobs = {peer.to_base58(): gathered_blob(entry) for peer, entry in zip(peer_ids, gathered, strict=False)}
    return {peer: blob for peer, blob in blobs.items() if blob is not None}


def gathered_blob(entry: bytes) -> bytes | None:
    """The blob a member gathered (our msgpack round info) from hivemind's entry for it, msgpack of
    [bandwidth, mode, msgpack of the blob]; None if the entry is not so."""
    try:
        _, _, wrapped = MSGPackSerializer.loads(entry)
        blob = MSGPackSerializer.loads(wrapped)
    except Exception:  # a member's bytes may be anything
        return None
    return blob if isinstance(blob, bytes) else None
