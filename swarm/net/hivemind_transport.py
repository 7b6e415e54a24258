"""``Store`` and ``GroupTransport`` on hivemind: records in its DHT, groups as its averagers.

    store = HivemindStore(dht)                  # records under a subkey are signed: see ``put``
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

from swarm.net.direct_digests import DirectDigests
from swarm.net.hivemind_codecs import hivemind_compression
from swarm.net.hivemind_group import HivemindGroup, close_groups, download_state
from swarm.net.identity import peer_id_of_owner
from swarm.net.timing import Timing
from swarm.net.transport import Served, is_dense_group
from swarm.sync.codecs import CODECS, Codec
from swarm.sync.robust_mean import AggregationRule


def _result(future, timeout: float):
    try:
        return future.result(timeout=timeout)
    except Exception:  # timeouts and network errors: the caller treats it as "nothing known"
        return None


# How many of the nodes nearest a key a read or a write keeps while it crawls the DHT: hivemind stores a
# record on its ``num_replicas`` (5) nearest nodes, so those hold the freshest copy. hivemind's default
# is its bucket size (20): in a swarm of up to 20 nodes every read and write asked every node, each
# answering with every peer's record, and heartbeats grew with the square of the swarm. Heartbeats alone,
# per peer per 5 s (``benchmarks/heartbeats.py``, 2 cores): 1203 kB at 16 peers, 458 kB with 5; 300 and
# 215 kB at 8 peers; 76 kB either way at 4 (at 5 nodes or fewer nothing changes).
CRAWL_BEAM = 5


class HivemindStore:
    """Records in hivemind's DHT. A record under a subkey is a peer's own: written under its owner tag
    (``swarm.net.identity``) and signed by its key, so nobody else can write it, and read back under the
    writer's peer id; a subkey that is not an owner tag (written by a plain hivemind node, say) is not read.
    ``beam``: ``CRAWL_BEAM``, or None for hivemind's default (benchmarks compare the two)."""

    def __init__(self, dht: hivemind.DHT, beam: int | None = CRAWL_BEAM) -> None:
        self.dht, self.me = dht, dht.peer_id.to_base58()
        self._crawl = {} if beam is None else {"beam_size": beam}
        identity = getattr(dht, "identity", None)  # set by start_dht
        self.owner = identity.owner_subkey if identity is not None else None
        self.swarm_key = getattr(dht, "swarm_key", None)  # its allowlist: the only writers read

    def now(self) -> float:
        return get_dht_time()

    def put(
        self, key: str, value: Any, expires_at: float, subkey: str | None = None, timeout: float = 10.0
    ) -> bool:
        if subkey is not None:
            if subkey != self.me or self.owner is None:
                raise ValueError(f"a peer writes its own subkey only ({self.me[-8:]}, not {subkey[-8:]})")
            subkey = self.owner
        fut = self.dht.store(key, value, expires_at, subkey=subkey, return_future=True, **self._crawl)
        return bool(_result(fut, timeout))

    def get(self, key: str, timeout: float = 10.0) -> Any | None:
        found = _result(self.dht.get(key, latest=True, return_future=True, **self._crawl), timeout)
        if found is None or found.expiration_time <= get_dht_time():
            return None
        return found.value

    def get_subkeys(self, key: str, timeout: float = 10.0) -> dict[str, tuple[Any, float]] | None:
        found = _result(self.dht.get(key, latest=True, return_future=True, **self._crawl), timeout)
        if found is None:
            return None
        if not isinstance(found.value, dict):
            return {}
        now, out = get_dht_time(), {}
        for sub, item in found.value.items():
            writer = peer_id_of_owner(sub)  # the signature was checked by the DHT node that read it
            allowed = writer is not None and (self.swarm_key is None or self.swarm_key.allows(writer))
            if allowed and getattr(item, "expiration_time", 0) > now:
                out[writer] = (getattr(item, "value", None), item.expiration_time)
        return out


class HivemindTransport:
    """See the module docstring."""

    def __init__(
        self,
        dht: hivemind.DHT,
        timing: Timing,
        codec: Codec = CODECS["fp32"],
        rule: AggregationRule | None = None,
        max_copy_bytes: int | None = None,
        dense_codec: Codec | None = None,
    ) -> None:
        """``codec``: how expert groups' all-reduces travel, ``dense_codec`` the dense group's (default:
        ``codec``); ``rule``: how our averagers reduce their parts (``swarm.sync.robust_mean``; None: the
        mean); ``max_copy_bytes``: the largest served copy ``fetch`` takes (``copy_bound``); None: any."""
        self.dht, self.timing, self.codec, self.rule = dht, timing, codec, rule
        self.dense_codec = dense_codec or codec
        self.max_copy_bytes = max_copy_bytes
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
            late_s=t.late_s,
            compression=hivemind_compression(self.dense_codec if is_dense_group(name) else self.codec),
            serve_compression=self._serving(name, serve_codec),
            rule=self.rule,
        )

    @staticmethod
    def _serving(name: str, codec: Codec | None):
        """How a group's served copies travel: the dense copy exactly (the final agreement copies it), a
        server's by its codec when it has one (expert changes), anything else (expert copies) as fp16."""
        if is_dense_group(name):
            return NoCompression()
        return hivemind_compression(codec) if codec else None

    def open(self, name: str, like: Sequence[torch.Tensor]) -> HivemindGroup:
        return self._group(name, like)

    def open_server(self, name: str, codec: Codec | None = None) -> HivemindGroup:
        return self._group(name, None, codec)

    def fetch(
        self,
        peer: str,
        name: str,
        timeout: float,
        accept: Callable[[dict[str, Any]], bool] | None = None,
        hold_s: float = 0.0,
    ) -> Served | None:
        got = download_state(self.dht, peer, name, timeout, accept, self.max_copy_bytes, min(hold_s, timeout))
        if got is None:
            return None
        meta = got[0] if isinstance(got[0], dict) else {}  # it answered, but serves nothing (yet)
        return Served(meta, list(got[1]), got[2])

    def close_groups(self, groups: Sequence[HivemindGroup]) -> None:
        close_groups(groups)

    def direct_digests(self) -> DirectDigests:
        return DirectDigests(self.dht)


def copy_bound(model: torch.nn.Module) -> int:
    """The most a served copy of this model's tensors can take on the wire: every parameter in fp32 (the
    dense copy travels exactly, expert copies in fp16 or less), plus framing."""
    return int(4.2 * sum(p.numel() for p in model.parameters())) + 2**20
