"""What a run keeps in the DHT: the config fingerprint and one heartbeat record per peer.

Keys are prefixed by the run id, and every record is its writer's own, under its peer id as subkey (on
hivemind, signed: ``HivemindStore``): ``<run>_config`` holds each peer's fingerprint of the model config
(a peer whose model no writer shares is refused); ``<run>_peers`` holds its heartbeat: experts, step,
tokens, loss, tokens/s, last round, bytes, state. Heartbeats expire after a few heartbeat periods, so a
peer that dies disappears by itself. Values are plain msgpack types (hivemind's own serialiser; no pickle),
and a reader takes a record only if every field is well formed (``Heartbeat.from_value``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import hivemind

from swarm.net.transport import Store

log = logging.getLogger(__name__)
CONFIG_TTL_S = 24 * 3600.0
STATES = ("joining", "training", "finishing", "done", "leaving")
MAX_EXPERTS = 4096  # more experts than any record may name (a bound on what a reader accepts)
MAX_COUNT = 2**62  # counters (steps, tokens, bytes) above this are not real
MAX_ADDRS, MAX_ADDR_LEN = 8, 256  # a peer's entry points, as its heartbeat lists them


class FingerprintMismatch(RuntimeError):
    """The swarm trains a different model than this peer's config describes."""


@dataclass
class Heartbeat:
    """One peer's public state, published every heartbeat period."""

    experts: list[int]
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    last_round: int = -1
    last_round_time: float | None = None
    bytes_sent: int = 0
    bytes_recv: int = 0
    state: str = "joining"  # joining | training | finishing (in its last round) | done | leaving
    rounds_ok: int = 0
    rounds_failed: int = 0
    period_s: float = 0.0  # how often this peer publishes (readers call it stale after two missed periods)
    sent_at: float | None = None  # DHT time of publication, set by publish_heartbeat
    first_step_at: float | None = None  # DHT time of this process's first training step
    addrs: list[str] = field(default_factory=list)  # multiaddrs others may join the swarm through

    def to_value(self) -> dict[str, Any]:
        value = asdict(self)
        if value["loss"] is not None and not math.isfinite(value["loss"]):
            value["loss"] = None
        return value

    @classmethod
    def from_value(cls, value: Any) -> Heartbeat | None:
        """Parse a record written by another peer: every field of the right type and range, or None (a
        malformed record is ignored whole: one wrong field makes the rest untrustworthy)."""
        if not isinstance(value, dict) or not isinstance(value.get("experts"), list):
            return None
        experts = value["experts"]
        if len(experts) > MAX_EXPERTS or not all(_whole(e, top=MAX_EXPERTS - 1) for e in experts):
            return None
        if len(set(experts)) != len(experts):  # only ints by now: hashable
            return None
        fields = {k: value[k] for k in cls.__dataclass_fields__ if k in value}
        counts = ("step", "tokens", "bytes_sent", "bytes_recv", "rounds_ok", "rounds_failed")
        ok = (
            all(_whole(fields.get(k, 0)) for k in counts)
            and _whole(fields.get("last_round", -1), low=-1)
            and all(finite_number(fields.get(k, 0.0), low=0.0) for k in ("tokens_per_s", "period_s"))
            and all(
                fields.get(k) is None or finite_number(fields[k])
                for k in ("loss", "last_round_time", "sent_at", "first_step_at")
            )
            and fields.get("state", "joining") in STATES
            and _addresses(fields.get("addrs", []))
        )
        return cls(**fields) if ok else None


def _addresses(v: Any) -> bool:
    """A short list of multiaddr-looking strings (what the dashboard shows as entry points)."""
    return (
        isinstance(v, list)
        and len(v) <= MAX_ADDRS
        and all(
            isinstance(a, str) and a.startswith("/") and 0 < len(a) <= MAX_ADDR_LEN and a.isprintable()
            for a in v
        )
    )


def _whole(v: Any, low: int = 0, top: int = MAX_COUNT) -> bool:
    """An int in [low, top] (a bool is an int to Python, not to a record)."""
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= top


def finite_number(v: Any, low: float = -math.inf) -> bool:
    """A finite int or float (not a bool) >= ``low``: what a number read from another peer must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low


def as_store(store_or_dht: Store | hivemind.DHT) -> Store:
    """Callers may hand a hivemind DHT (the dashboard, tools): wrap it."""
    if isinstance(store_or_dht, hivemind.DHT):
        from swarm.net.hivemind_transport import HivemindStore

        return HivemindStore(store_or_dht)
    return store_or_dht


def check_or_publish_fingerprint(
    store: Store | hivemind.DHT, run_id: str, me: str, fingerprint: str, timeout: float = 10.0
) -> None:
    """Refuse a run whose every peer that published a config fingerprint published another; then publish
    ours. Each peer's fingerprint is its own signed record (``<run>_config``, under its peer id), so no
    writer can replace the others': a stranger's record alone cannot lock out a run that has peers."""
    store, key = as_store(store), f"{run_id}_config"
    found = store.get_subkeys(key, timeout) or {}
    theirs = [v for v, _ in found.values() if isinstance(v, str) and 0 < len(v) <= 128]
    if theirs and fingerprint not in theirs:
        common = max(sorted(set(theirs)), key=theirs.count)
        raise FingerprintMismatch(
            f"run {run_id!r} in this swarm trains another model (config fingerprint {common} from "
            f"{theirs.count(common)} peer(s), ours {fingerprint}); use the swarm's config or another run_id"
        )
    store.put(key, fingerprint, store.now() + CONFIG_TTL_S, subkey=me, timeout=timeout)


def publish_heartbeat(
    store: Store | hivemind.DHT, run_id: str, peer_id: str, hb: Heartbeat, ttl_s: float, timeout: float = 10.0
) -> bool:
    store = as_store(store)
    now = store.now()
    value = hb.to_value() | {"sent_at": now}
    return store.put(f"{run_id}_peers", value, now + ttl_s, subkey=peer_id, timeout=timeout)


def withdraw_heartbeat(
    store: Store | hivemind.DHT, run_id: str, peer_id: str, hb: Heartbeat, ttl_s: float, timeout: float = 5.0
) -> None:
    """Replace our record with a ``leaving`` one, which readers skip (hivemind has no delete). It must
    outlive the record it replaces (``ttl_s`` as published): hivemind ignores a store that expires sooner."""
    store = as_store(store)
    hb.state = "leaving"
    now = store.now()
    value = hb.to_value() | {"sent_at": now}
    store.put(f"{run_id}_peers", value, now + ttl_s + 1, subkey=peer_id, timeout=timeout)


def read_records(
    store: Store | hivemind.DHT, run_id: str, timeout: float = 10.0
) -> dict[str, tuple[Heartbeat, float]] | None:
    """Every well-formed record, ``leaving`` ones included: {peer id: (heartbeat, expiration time)}, or
    None when the store does not answer in time."""
    found = as_store(store).get_subkeys(f"{run_id}_peers", timeout)
    if found is None:
        return None
    out = {}
    for subkey, (value, expiration) in found.items():
        hb = Heartbeat.from_value(value)
        if hb is not None:
            out[subkey] = (hb, expiration)
        else:
            dropped_once(f"malformed heartbeat from {subkey[-12:]!r} ignored: {str(value)[:80]}")
    return out


_said: set[str] = set()


def dropped_once(message: str) -> None:
    """Log what was dropped, once per distinct message (a bad record is read again every heartbeat)."""
    if message not in _said and len(_said) < 10_000:
        _said.add(message)
        log.warning(message)


def read_heartbeats(
    store: Store | hivemind.DHT, run_id: str, timeout: float = 10.0
) -> dict[str, tuple[Heartbeat, float]]:
    """Live peers: {peer id: (heartbeat, expiration time)}. Empty when the store does not answer in time."""
    found = read_records(store, run_id, timeout) or {}
    return {peer: rec for peer, rec in found.items() if rec[0].state != "leaving"}


def expert_holders(heartbeats: dict[str, tuple[Heartbeat, float]], n_experts: int) -> dict[int, set[str]]:
    holders: dict[int, set[str]] = {e: set() for e in range(n_experts)}
    for peer, (hb, _) in heartbeats.items():
        for e in hb.experts:
            if 0 <= e < n_experts:
                holders[e].add(peer)
    return holders
