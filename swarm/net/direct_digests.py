"""Round digests sent straight to the members of a group, not through the DHT.

    digests = DirectDigests(dht)                         # its mailbox answers in the DHT's process
    digests.publish(key, mine, members, timeout=5.0)     # kept for askers, and sent to every other member
    seen = digests.collect(key, members, timeout=1.0)    # {member: digest} of those that have come

Storing a digest in the DHT takes a lookup (RPCs that find the nodes nearest the key) and then a store at
each of them, and reading the others' digests takes another lookup, polled. On links whose queues hold a
round's bulk data, every one of those RPCs waits behind it (benchmarks/README, "Paced CPU peers"). Members of a
group have just exchanged tensors, so they can reach each other: here a digest is one message to each
member. Each message carries the sender's digest for a group key (or none yet) and is answered with the
receiver's own digest for that key, if it has one. So a member that publishes late learns the others'
digests from the answers, and a member still missing one asks that member again (``collect`` re-sends to
the members not heard from, at most every ``RESEND_S``).

Who sent a digest is the libp2p connection's authenticated peer id, so a member writes only its own entry,
as with a signed DHT subkey. With a swarm key, a message must carry the sender's member token, or it is
ignored. Messages are msgpack (nothing is unpickled) of at most ``MAX_MESSAGE`` bytes. The mailbox keeps a
group key for ``KEEP_S`` seconds, ``MAX_KEYS`` keys in all and ``MAX_KEYS_PER_PEER`` from any one sender
(the oldest go first), so a flood of keys costs bounded memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from typing import Any

import hivemind
import msgpack
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto.averaging_pb2 import DownloadData  # one bytes field (``metadata``) carries our msgpack

from swarm.net.round_consensus import MAX_PAIRS

HANDLER = "swarm_round_digest"
MAX_MESSAGE = 8192
MAX_KEY = 200
KEEP_S = 300.0
MAX_KEYS = 256
MAX_KEYS_PER_PEER = 16
REQUEST_S = 5.0  # one message and its answer
RESEND_S = 0.5
OPEN_S = 30.0  # registering the handler in the DHT's process
ATTRIBUTE = "_swarm_digest_mailbox"  # where the mailbox lives on the DHT process's node


def _digest(value: Any) -> list[float] | None:
    """A digest as it may travel: a list of at most 2 x MAX_PAIRS numbers (their values are checked by
    ``digests_agree``), else None."""
    ok = isinstance(value, list) and len(value) <= 2 * MAX_PAIRS
    if ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return [float(x) for x in value]
    return None


def _parse(blob: bytes) -> tuple[bytes, str, list[float] | None] | None:
    """(token, key, digest or None) from a message, or None for anything malformed."""
    if len(blob) > MAX_MESSAGE:
        return None
    try:
        token, key, value = msgpack.unpackb(blob, raw=False)
    except Exception:  # a caller's bytes may be anything
        return None
    if not isinstance(token, bytes) or not isinstance(key, str) or len(key) > MAX_KEY:
        return None
    digest = _digest(value)
    return (token, key, digest) if value is None or digest is not None else None


class Mailbox:
    """The digests this peer knows, per group key and sender (it lives in the DHT's process)."""

    def __init__(self, me: str, swarm_key=None) -> None:
        self.me, self.swarm_key = me, swarm_key
        self.boxes: dict[
            str, tuple[float, dict[str, list[float]]]
        ] = {}  # key -> (first seen, sender -> digest)
        self.sent: dict[tuple[str, str], float] = {}  # (key, member) -> when we last sent to it
        self.tasks: set[asyncio.Task] = set()

    def keep(self, key: str, sender: str, digest: list[float]) -> None:
        now = time.monotonic()
        self._prune(now)
        if key not in self.boxes:
            theirs = [k for k, (_, box) in self.boxes.items() if sender in box]
            if len(theirs) >= MAX_KEYS_PER_PEER:  # a sender's oldest key makes room for its new one
                self.boxes[theirs[0]][1].pop(sender)
            if len(self.boxes) >= MAX_KEYS:
                self.boxes.pop(next(iter(self.boxes)))
            self.boxes[key] = (now, {})
        self.boxes[key][1][sender] = digest

    def _prune(self, now: float) -> None:
        for key in [k for k, (born, _) in self.boxes.items() if now - born > KEEP_S]:
            del self.boxes[key]
        self.sent = {ks: t for ks, t in self.sent.items() if now - t <= KEEP_S}

    def known(self, key: str) -> dict[str, list[float]]:
        return dict(self.boxes.get(key, (0.0, {}))[1])

    async def handle(self, request: DownloadData, context: P2PContext) -> DownloadData:
        got = _parse(request.metadata)
        if got is None:
            return DownloadData()
        token, key, digest = got
        sender = context.remote_id.to_base58()
        if self.swarm_key is not None and not self.swarm_key.admits(sender, token):
            return DownloadData()
        if digest is not None and sender != self.me:
            self.keep(key, sender, digest)
        own = self.known(key).get(self.me)
        return DownloadData(metadata=msgpack.packb(own) if own is not None else b"")

    def send(self, p2p, member: str, key: str, token: bytes) -> None:
        """Send our digest for ``key`` (or none yet) to ``member`` in the background; its answer is kept."""
        self.sent[(key, member)] = time.monotonic()
        task = asyncio.create_task(self._exchange(p2p, member, key, token))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _exchange(self, p2p, member: str, key: str, token: bytes) -> None:
        message = DownloadData(metadata=msgpack.packb([token, key, self.known(key).get(self.me)]))
        try:
            call = p2p.call_protobuf_handler(PeerID.from_base58(member), HANDLER, message, DownloadData)
            blob = (await asyncio.wait_for(call, REQUEST_S)).metadata
            theirs = msgpack.unpackb(blob, raw=False) if 0 < len(blob) <= MAX_MESSAGE else None
        except Exception:  # gone, slow, or it answered garbage: asked again on the next collect
            return
        digest = _digest(theirs)
        if digest is not None:
            self.keep(key, member, digest)


async def _open(_dht, node, swarm_key) -> None:
    if getattr(node, ATTRIBUTE, None) is None:
        mailbox = Mailbox(node.peer_id.to_base58(), swarm_key)
        await node.p2p.add_protobuf_handler(HANDLER, mailbox.handle, DownloadData)
        setattr(node, ATTRIBUTE, mailbox)


async def _publish(_dht, node, key: str, digest: list[float], members: list[str], token: bytes) -> bool:
    mailbox: Mailbox = getattr(node, ATTRIBUTE)
    mailbox.keep(key, mailbox.me, digest)
    for member in members:
        if member != mailbox.me:
            mailbox.send(node.p2p, member, key, token)
    return True


async def _collect(_dht, node, key: str, members: list[str], token: bytes) -> dict[str, list[float]]:
    mailbox: Mailbox = getattr(node, ATTRIBUTE)
    known, now = mailbox.known(key), time.monotonic()
    for member in members:
        if member not in known and now - mailbox.sent.get((key, member), -RESEND_S) >= RESEND_S:
            mailbox.send(node.p2p, member, key, token)
    return {m: d for m, d in known.items() if m in members}


class DirectDigests:
    """See the module docstring (a ``DigestExchange``). Raises ``RuntimeError`` if the DHT's process does
    not register the handler within ``OPEN_S``."""

    poll_s = 0.05  # a look is a message to our own DHT process, not a request on the network

    def __init__(self, dht: hivemind.DHT) -> None:
        self.dht, self.me = dht, dht.peer_id.to_base58()
        key = getattr(dht, "swarm_key", None)
        self.token = key.member_token(self.me) if key is not None else b""
        try:
            dht.run_coroutine(functools.partial(_open, swarm_key=key), return_future=True).result(OPEN_S)
        except Exception as e:
            raise RuntimeError(f"round digests: the DHT's process did not open the mailbox: {e}") from None

    def _run(self, fn, timeout: float, **kwargs):
        try:
            future = self.dht.run_coroutine(functools.partial(fn, **kwargs), return_future=True)
            return future.result(timeout=timeout)
        except Exception:  # the DHT's process is gone or busy: nothing known this time
            return None

    def publish(self, key: str, digest: list[float], members: Sequence[str], timeout: float) -> bool:
        kwargs = dict(key=key, digest=list(digest), members=list(members), token=self.token)
        return bool(self._run(_publish, timeout, **kwargs))

    def collect(self, key: str, members: Sequence[str], timeout: float) -> dict[str, Any] | None:
        return self._run(_collect, timeout, key=key, members=list(members), token=self.token)
