"""A reply stream's last messages reach the caller: the handler keeps its end open until the caller closes
it, and the caller closes once it has every message it expects.

    async for message in lingering(replies):   # in a handler: its replies, then up to LINGER_S more
        yield message
    async for message in closing_after(stream, parts):  # in a caller: ``parts`` messages, then close
        ...

hivemind's p2pd pipes each stream between a unix socket and a libp2p stream (learning-at-home/go-libp2p-
daemon, ``stream.go``). When a handler returns, its socket closes and the daemon closes the libp2p stream;
the copy in the other direction then fails, and the daemon resets the stream. The caller's daemon drops
what it had received but not yet passed on when the reset arrives, and the caller's hivemind reads the
closed socket as a clean end of stream. So a handler that returns right after its last message can lose
the last messages: with plain hivemind P2P on 127.0.0.1, 15 of 65 fresh pairs of daemons lost a whole
three-message reply in at least one of 10 calls (none in 250 calls with these two). In a round that was a
reducer's last averaged parts ("peer X sent 27 parts, but we expected 32": a partial all-reduce) or a
leader's begin message (a member counted in a group it never heard of). A handler whose caller closes first
never resets under a reply in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from hivemind.proto import averaging_pb2

# how long a handler keeps its stream open after its last message for a caller that does not close it
LINGER_S = 1.0


async def lingering(replies: AsyncIterator[Any], linger_s: float | None = None) -> AsyncIterator[Any]:
    """Every reply, then the stream held open up to ``linger_s`` (None: ``LINGER_S`` as it is now; the
    caller's close ends the wait: hivemind cancels a handler whose caller has gone)."""
    async for reply in replies:
        yield reply
    await asyncio.sleep(LINGER_S if linger_s is None else linger_s)


async def closing_after(stream: AsyncIterator[Any], parts: int) -> AsyncIterator[Any]:
    """The messages of a reply stream, closed as soon as ``parts`` averaged parts have come (or a message
    that is not one: hivemind reports it), instead of waiting for the handler to close it."""
    got = 0
    try:
        async for message in stream:
            yield message
            got += 1
            if message.code != averaging_pb2.AVERAGED_PART or 0 < parts <= got:
                break
    finally:
        await stream.aclose()


class ClosingStub:
    """A peer's averaging stub whose ``rpc_aggregate_part`` stream is closed after ``parts`` parts."""

    def __init__(self, stub: Any, parts: int) -> None:
        self._stub, self._parts = stub, parts

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        return closing_after(await self._stub.rpc_aggregate_part(inputs), self._parts)
