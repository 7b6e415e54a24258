"""One averaging group per tensor set: the dense weights, or one expert (all layers), over hivemind.

    group = AveragingGroup(dht, prefix="demo_expert3", tensors=[...], timeouts=...)
    control = group.start(snapshot, weight=tokens, info={...})   # returns at once; all-reduce runs in the
    ...                                                          # averager's own process
    outcome = group.outcome(control, timeout)                    # GroupOutcome: tensors + members, or why not

Peers that hold the same expert use the same prefix, so hivemind's matchmaking groups exactly them.
Each group also serves its latest tensors (the last completed average, or our own snapshot when we are
the only holder) to peers that download the expert (``download_state``). hivemind reports success for
partially averaged tensors and trusts every sender (NOTES.md): the caller verifies outcomes with
``swarm.net.round_consensus`` and ``swarm.sync.check_tensor`` before applying anything.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.compression import Float16Compression, NoCompression
from hivemind.utils import MSGPackSerializer

from swarm.net.dht_node import hivemind_child_signals

MAX_INFO_BYTES = 4096
SHUTDOWN_S = 5.0  # each averager's own grace period (``shutdown_timeout``) before hivemind terminates it


@dataclass
class GroupOutcome:
    ok: bool
    reason: str = ""
    tensors: list[torch.Tensor] = field(default_factory=list)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # peer id -> the info it gathered
    seconds: float = 0.0


class _ServingAverager(hivemind.DecentralizedAverager):
    """Serves its latest tensors plus our metadata to downloaders (runs in the host process)."""

    def get_current_state(self):
        meta_lock = getattr(self, "serve_lock", None)
        if meta_lock is None:
            return {}, [], None
        with meta_lock:
            meta = dict(self.serve_meta)
        with self.get_tensors() as tensors:
            return meta, [t.clone() for t in tensors], None

    async def _shutdown(self, timeout):
        # hivemind leaves the averager's P2P replica open at shutdown, and its client socket file in /tmp
        # behind; close it so that a clean exit leaves nothing
        try:
            await super()._shutdown(timeout)
        finally:
            p2p = getattr(self, "_p2p", None)
            if p2p is not None:
                await p2p.shutdown()


class AveragingGroup:
    """A hivemind DecentralizedAverager for one prefix, with every timeout set and state sharing on."""

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        like: Sequence[torch.Tensor],
        *,
        min_group_size: int = 2,
        matchmaking_time: float = 5.0,
        allreduce_timeout: float = 60.0,
        request_timeout: float = 5.0,
        fp16_state: bool = True,
    ) -> None:
        self.prefix = prefix
        with hivemind_child_signals():
            self.averager = _ServingAverager(
                # always host tensors: hivemind's compression calls .numpy() and fails on CUDA tensors
                [torch.zeros(t.shape, dtype=torch.float32, device="cpu") for t in like],
                dht,
                prefix=prefix,
                start=True,
                min_group_size=min_group_size,
                min_matchmaking_time=matchmaking_time,
                request_timeout=request_timeout,
                allreduce_timeout=allreduce_timeout,
                next_chunk_timeout=request_timeout,
                sender_timeout=request_timeout,
                reducer_timeout=2 * request_timeout,
                compression=NoCompression(),
                state_compression=Float16Compression() if fp16_state else NoCompression(),
                allow_state_sharing=True,
                declare_state_period=10.0,
                shutdown_timeout=SHUTDOWN_S,
            )
        self.averager.serve_lock, self.averager.serve_meta = threading.Lock(), {}

    def _set_meta(self, meta: dict[str, Any]) -> None:
        with self.averager.serve_lock:
            self.averager.serve_meta = dict(meta)

    def publish(self, tensors: Sequence[torch.Tensor], meta: dict[str, Any]) -> None:
        """Make ``tensors`` what this group serves to downloaders (used by a sole holder)."""
        with self.averager.get_tensors() as mine:
            for dst, src in zip(mine, tensors, strict=True):
                dst.copy_(src)
        self._set_meta(meta)

    def start(
        self,
        snapshot: Sequence[torch.Tensor],
        weight: float,
        info: dict[str, Any],
        matchmaking_timeout: float,
        scheduled_time: float | None = None,
    ) -> StepControl:
        """Load ``snapshot`` and begin a round in the background. ``info`` is gathered by all members."""
        with self.averager.get_tensors() as mine:
            for dst, src in zip(mine, snapshot, strict=True):
                dst.copy_(src)
        gather = MSGPackSerializer.dumps(info)
        if len(gather) > MAX_INFO_BYTES:
            raise ValueError("round info too large")
        return self.averager.step(
            gather=gather,
            weight=weight,
            timeout=matchmaking_timeout,
            scheduled_time=scheduled_time,  # None: now + the matchmaking time
            wait=False,
            allow_retries=False,
        )

    def outcome(
        self, control: StepControl, timeout: float, meta: dict[str, Any] | None = None
    ) -> GroupOutcome:
        """Wait (at most ``timeout``) for the round; return the averaged tensors and who took part."""
        t0 = time.perf_counter()
        try:
            gathered = control.result(timeout=timeout)
        except Exception as e:  # TimeoutError, cancelled, allreduce failure
            control.cancel()
            return GroupOutcome(False, f"{type(e).__name__}: {e}"[:200], seconds=time.perf_counter() - t0)
        if not gathered:
            return GroupOutcome(False, "no group formed", seconds=time.perf_counter() - t0)
        members = {}
        for peer, blob in gathered.items():
            try:
                info = (
                    MSGPackSerializer.loads(blob)
                    if isinstance(blob, bytes) and len(blob) <= MAX_INFO_BYTES
                    else None
                )
            except Exception:
                info = None
            if not isinstance(info, dict):
                return GroupOutcome(
                    False, f"malformed round info from {peer}", seconds=time.perf_counter() - t0
                )
            members[peer.to_base58()] = info
        with self.averager.get_tensors() as mine:
            tensors = [t.clone() for t in mine]
        if meta is not None:
            self._set_meta(meta)
        return GroupOutcome(True, tensors=tensors, members=members, seconds=time.perf_counter() - t0)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception:
            pass


def shutdown_groups(groups: Sequence[AveragingGroup], timeout: float = SHUTDOWN_S + 2.0) -> None:
    """Shut groups down side by side, so that leaving takes one grace period, not one per local expert."""
    threads = [threading.Thread(target=g.shutdown, name="swarm-group-shutdown", daemon=True) for g in groups]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


async def _download(dht, node, peer: str, prefix: str, timeout: float):
    """Runs inside the DHT process (``dht.run_coroutine``): stream one group's state from ``peer``.
    Tensors arrive in hivemind's own serialisation and metadata in msgpack: nothing is unpickled."""
    import asyncio

    from hivemind.compression import deserialize_torch_tensor
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.streaming import combine_from_streaming

    async def fetch():
        stub = _ServingAverager.get_stub(node.p2p, PeerID.from_base58(peer), namespace=prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        meta, parts, tensors = None, [], []
        async for msg in stream:
            if msg.metadata:
                meta = MSGPackSerializer.loads(msg.metadata)
            if msg.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(msg.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return meta, tensors

    return await asyncio.wait_for(fetch(), timeout)


def download_state(dht: hivemind.DHT, peer: str, prefix: str, timeout: float = 30.0):
    """(metadata, tensors) of group ``prefix`` as served by ``peer``, or None on any failure or timeout."""
    try:
        fn = functools.partial(_download, peer=peer, prefix=prefix, timeout=timeout)  # picklable, importable
        return dht.run_coroutine(fn, return_future=True).result(timeout=timeout + 5)
    except Exception:
        return None
