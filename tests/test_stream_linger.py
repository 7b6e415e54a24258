"""A reply stream held open by its handler until the caller, which has every message, closes it: in process,
then over two real p2p daemons on 127.0.0.1."""

import asyncio
import time

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from swarm.net.stream_linger import closing_after, lingering

pytestmark = pytest.mark.timeout(120)
PART = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
REFUSAL = averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)


class _Stream:
    """A reply stream as hivemind's caller gets it: messages, then an end; remembers being closed."""

    def __init__(self, messages):
        self.messages, self.read, self.closed = list(messages), 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.read == len(self.messages):
            raise StopAsyncIteration
        self.read += 1
        return self.messages[self.read - 1]

    async def aclose(self):
        self.closed = True


async def _collect(aiter):
    return [m async for m in aiter]


@pytest.mark.parametrize(
    "messages, parts, got",
    [
        ([PART] * 5, 3, 3),  # closed once the parts it expects have come
        ([PART, REFUSAL, PART], 3, 2),  # a message that is not a part ends it: hivemind reports it
        ([PART] * 2, 3, 2),  # a short stream: all of it (hivemind counts the parts)
        ([PART] * 4, 0, 4),  # no count: read to the end
    ],
)
def test_a_caller_closes_the_stream_once_it_has_every_part(messages, parts, got):
    stream = _Stream(messages)
    assert len(asyncio.run(_collect(closing_after(stream, parts)))) == got
    assert stream.read == got and stream.closed


def test_a_handler_holds_its_stream_after_its_last_reply_until_the_caller_closes_it():
    async def run():
        replies = lingering(_Stream([PART, PART]).__aiter__(), linger_s=0.3)
        t0 = time.monotonic()
        assert len(await _collect(replies)) == 2
        waited = time.monotonic() - t0  # nobody closed: the whole linger
        held = asyncio.ensure_future(_collect(lingering(_Stream([PART]), linger_s=60)))
        await asyncio.sleep(0.1)
        assert not held.done()  # its one reply sent, it still holds the stream
        held.cancel()  # what hivemind does to a handler whose caller has closed
        await asyncio.gather(held, return_exceptions=True)
        return waited, held.cancelled()

    waited, cancelled = asyncio.run(run())
    assert waited >= 0.3 and cancelled


def test_every_reply_arrives_and_the_callers_close_ends_the_handlers_wait():
    """20 calls of a handler that replies three times and would hold its stream 30 s: each caller gets
    all three and closes, and the handler's wait ends with it."""

    async def run():
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        ended = []
        try:

            async def handler(requests, context):
                async for _ in requests:
                    break

                async def replies():
                    for _ in range(3):
                        yield PART

                try:
                    async for reply in lingering(replies(), linger_s=30):
                        yield reply
                finally:
                    ended.append(time.monotonic())

            await server.add_protobuf_handler(
                "t_linger", handler, averaging_pb2.AveragingData, stream_input=True, stream_output=True
            )
            got, took = [], []
            for _ in range(20):

                async def ask():
                    yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)

                t0 = time.monotonic()
                stream = await client.iterate_protobuf_handler(
                    server.peer_id, "t_linger", ask(), averaging_pb2.AveragingData
                )
                got.append(len(await _collect(closing_after(stream, 3))))
                took.append(time.monotonic() - t0)
            await asyncio.sleep(1.0)  # the last handler hears of its caller's close
            return got, took, len(ended)
        finally:
            await client.shutdown()
            await server.shutdown()

    got, took, ended = asyncio.run(run())
    assert got == [3] * 20
    assert max(took) < 10  # not the handler's 30 s: the caller closed first
    assert ended == 20  # every handler's wait ended with its caller's close
