"""``Store`` and ``GroupTransport`` on hivemind: records in its DHT, groups as its averagers.

    store = HivemindStore(dht)
    transport = HivemindTransport(dht, timing, codec_named("int8"))  # averaging groups send int8
    group = transport.open("demo_dense", like=buffers)

Every call is bounded: a DHT request that does not answer in time reads as "nothing known" (None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hivemind
import torch
from hivemind.compression import NoCompression
from hivemind.utils import get_dht_time

from swarm.net.hivemind_codecs import hivemind_compression
from swarm.net.hivemind_group import HivemindGroup, close_groups, download_state
from swarm.net.timing import Timing
from swarm.net.transport import Served
from swarm.sync.codecs import CODECS, Codec

DENSE_SUFFIX = "_dense"


def _result(future, timeout: float):
    try:
        return future.result(timeout=timeout)
    except Exception:  # timeouts and network errors: the caller treats it as "nothing known"
        return None


class HivemindStore:
    """See the module docstring."""

    def __init__(self, dht: hivemind.DHT) -> None:
        self.dht = dht

    def now(self) -> float:
        return get_dht_time()

    def put(
        self, key: str, value: Any, expires_at: float, subkey: str | None = None, timeout: float = 10.0
    ) -> bool:
        fut = self.dht.store(key, value, expires_at, subkey=subkey, return_future=True)
        return bool(_result(fut, timeout))

    def get(self, key: str, timeout: float = 10.0) -> Any | None:
        found = _result(self.dht.get(key, latest=True, return_future=True), timeout)
        if found is None or found.expiration_time <= get_dht_time():
            return None
        return found.value

    def get_subkeys(self, key: str, timeout: float = 10.0) -> dict[str, tuple[Any, float]] | None:
        found = _result(self.dht.get(key, latest=True, return_future=True), timeout)
        if found is None:
            return None
        if not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        return {
            sub: (getattr(item, "value", None), item.expiration_time)
            for sub, item in found.value.items()
            if isinstance(sub, str) and getattr(item, "expiration_time", 0) > now
        }


class HivemindTransport:
    """See the module docstring."""

    def __init__(self, dht: hivemind.DHT, timing: Timing, codec: Codec = CODECS["fp32"]) -> None:
        self.dht, self.timing, self.codec = dht, timing, codec
        self.me = dht.peer_id.to_base58()

    def _group(
        self, name: str, like: Sequence[torch.Tensor] | None, serve_codec: Codec | None = None
    ) -> HivemindGroup:
        t = self.timing
        return HivemindGroup(
            self.dht,
            name,
            like,
            matchmaking_time=t.matchmaking_s,
            allreduce_timeout=t.round_s,
            request_timeout=t.request_s,
            compression=hivemind_compression(self.codec),
            serve_compression=self._serving(name, serve_codec),
        )

    @staticmethod
    def _serving(name: str, codec: Codec | None):
        """How a group's served copies travel: the dense copy exactly (the final agreement copies it), a
        server's by its codec when it has one (expert changes), anything else (expert copies) as fp16."""
        if name.endswith(DENSE_SUFFIX):
            return NoCompression()
        return hivemind_compression(codec) if codec else None

    def open(self, name: str, like: Sequence[torch.Tensor]) -> HivemindGroup:
        return self._group(name, like)

    def open_server(self, name: str, codec: Codec | None = None) -> HivemindGroup:
        return self._group(name, None, codec)

    def fetch(
        self, peer: str, name: str, timeout: float, accept: Callable[[dict[str, Any]], bool] | None = None
    ) -> Served | None:
        got = download_state(self.dht, peer, name, timeout=timeout, accept=accept)
        if got is None:
            return None
        meta = got[0] if isinstance(got[0], dict) else {}  # it answered, but serves nothing (yet)
        return Served(meta, list(got[1]))

    def close_groups(self, groups: Sequence[HivemindGroup]) -> None:
        close_groups(groups)
