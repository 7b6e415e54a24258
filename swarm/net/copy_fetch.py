"""The caller's side of a download from a ``ServingAverager`` (its ``rpc_fetch_copy``).

    meta, tensors, held_s = await fetch_copy(dht, node, peer, "demo_experts", 30.0, token)  # DHT's process

Run inside the DHT's process (``HivemindGroup.fetch`` hands it to ``dht.run_coroutine``). Nothing is
unpickled: tensors come in hivemind's own serialisation, metadata in msgpack. The holder ends the copy with
``COPY_END`` and keeps its stream open until we close it, which we do as soon as that comes
(``stream_linger``: a stream that the holder closed first could lose the copy's last parts on the way).
"""

from __future__ import annotations

import asyncio

from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from swarm.net.serving_averager import ServingAverager, is_copy_end, metadata_digest
from swarm.net.transport import metadata_accepted


async def fetch_copy(
    dht,
    node,
    peer: str,
    prefix: str,
    timeout: float,
    token: bytes,
    accept=None,
    max_bytes: int | None = None,
    hold_s: float = 0.0,
):
    """Stream one group's served copy from ``peer``, showing our member ``token`` (b"" without a swarm
    key). A copy larger than ``max_bytes`` is cut off and gives None (a holder must not be able to fill our
    memory). With ``accept``, the metadata is asked first (``rpc_served_metadata``, a few bytes) and the
    copy only if ``accept`` takes it; the copy's own metadata is checked again (it may have changed
    meanwhile). After refused metadata, with ``hold_s``, the copy is asked for held: the holder sends it
    once it serves anything new (up to ``hold_s``), or its metadata alone.
    Gives (metadata, tensors, seconds held before the metadata was accepted), or None."""
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.p2p import PeerID
    from hivemind.utils.streaming import combine_from_streaming

    async def fetch():
        stub = ServingAverager.get_stub(node.p2p, PeerID.from_base58(peer), namespace=prefix)
        loop = asyncio.get_running_loop()
        began = loop.time()
        ask, held = averaging_pb2.JoinRequest(gather=token), False
        if accept is not None:  # the metadata first, alone: the copy travels only if it is worth having
            probe = await stub.rpc_served_metadata(ask)
            meta = MSGPackSerializer.loads(probe.metadata) if probe.metadata else {}
            if not metadata_accepted(accept, meta):
                if hold_s <= 0:
                    return meta, [], 0.0
                # the copy itself, asked at once but sent only once the holder serves anything new: one
                # request after the copy changes, not two (each may wait behind a full link's queue)
                seen, held = metadata_digest(probe.metadata), True
                ask = averaging_pb2.JoinRequest(gather=token, schema_hash=seen, expiration=hold_s)
        stream = await stub.rpc_fetch_copy(ask)
        meta, parts, tensors, size, held_s = None, [], [], 0, 0.0
        try:  # closed by us, at COPY_END at the latest: the holder's stream waits for that (``lingering``)
            async for msg in stream:
                if is_copy_end(msg):
                    break
                size += len(msg.tensor_part.buffer) + len(msg.metadata)
                if max_bytes is not None and size > max_bytes:
                    return None
                if msg.metadata:
                    meta = MSGPackSerializer.loads(msg.metadata)
                    held_s = loop.time() - began if held else 0.0
                    if accept is not None and not metadata_accepted(accept, meta):
                        return meta, [], 0.0  # what it serves now is for the caller to judge
                if not (msg.tensor_part.dtype or msg.tensor_part.buffer):  # metadata alone (a hold in vain)
                    continue
                if msg.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(msg.tensor_part)
        finally:
            await stream.aclose()
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return meta, tensors, held_s

    try:
        return await asyncio.wait_for(fetch(), timeout)
    except Exception:  # a dead or busy holder is an expected answer: None, not a traceback in the DHT's log
        return None
