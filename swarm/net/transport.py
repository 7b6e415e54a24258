"""The seam below a round: where records live (``Store``) and how tensor groups are averaged and served
(``GroupTransport``).

    group = transport.open("demo_dense", like=tensors)    # one averaging group, reused round after round
    handle = group.start(tensors, info, matchmaking_s=5.0) # returns at once
    handle = group.trigger(group.prematch(info, slot, 5.0), tensors)  # or: members met before the slot
    outcome = group.outcome(handle, timeout=60.0)          # GroupOutcome: averaged tensors + members' infos
    group.serve(tensors, meta)                             # what downloaders of this group get from us
    served = transport.fetch(peer, "demo_dense", timeout=30.0)

Two implementations: hivemind's DHT and averagers (``swarm.net.hivemind_transport``) and an in-memory one
with a fault plan for in-process protocol tests (``swarm.net.local_transport``). Members of a group average
with equal weight: per-item weights travel inside the tensors (``swarm.net.group_layout``), so that what a
member claims and what it really contributed can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swarm.sync.codecs import Codec

DENSE_SUFFIX = "_dense"  # ends the dense group's name (``group_layout.dense_spec``)


def is_dense_group(name: str) -> bool:
    """Whether a group is the dense weights': transports serve its copy exactly and may average it in a
    codec of its own (``sync.dense_codec``)."""
    return name.endswith(DENSE_SUFFIX)


def is_last_round(info: Mapping[str, Any]) -> bool:
    """Whether a round's info (``RoundInfo.to_msg``) is a last round's: those meet only each other."""
    return info.get("last") is True


@dataclass(frozen=True)
class GroupOutcome:
    """A finished group round: the averaged tensors and each member's gathered info, or why not."""

    ok: bool
    reason: str = ""
    tensors: list[torch.Tensor] = field(default_factory=list)
    members: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # peer id -> its round info
    formed_at: float | None = None  # time.monotonic() when the group had formed (its members known), if seen


@dataclass(frozen=True)
class Served:
    """A copy a peer serves under a group name: msgpack metadata and tensors (as they travelled)."""

    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    held_s: float = 0.0  # how long the holder held our ask before it served what ``accept`` took


def metadata_accepted(accept: Callable[[dict[str, Any]], bool], meta: Any) -> bool:
    """``accept(meta)``, false for metadata it chokes on (what comes from the network may be anything)."""
    try:
        return isinstance(meta, dict) and bool(accept(dict(meta)))
    except Exception:
        return False


class Store(Protocol):
    """Records with optional subkeys and an expiration time (on ``now()``'s clock). A subkey is a peer id,
    and a peer writes only its own (on hivemind: signed); a key without subkey can be written by anyone."""

    def now(self) -> float: ...

    def put(
        self, key: str, value: Any, expires_at: float, subkey: str | None = None, timeout: float = 10.0
    ) -> bool: ...

    def get(self, key: str, timeout: float = 10.0) -> Any | None:
        """The value of a key stored without subkey, or None (absent, expired or no answer in time)."""
        ...

    def get_subkeys(self, key: str, timeout: float = 10.0) -> dict[str, tuple[Any, float]] | None:
        """{subkey: (value, expiration)} of live entries, {} when there are none, None on no answer."""
        ...


class DigestExchange(Protocol):
    """How the members of a group tell each other the digests of their round results (``round_consensus``):
    through the ``Store`` (``round_consensus.StoreDigests``) or straight to each member
    (``direct_digests.DirectDigests``). ``poll_s``: how often a waiting member looks again, at most."""

    poll_s: float

    def publish(self, key: str, digest: list[float], members: Sequence[str], timeout: float) -> bool:
        """Make our ``digest`` for group ``key`` known to ``members``; whether it was, within ``timeout``."""
        ...

    def collect(self, key: str, members: Sequence[str], timeout: float) -> dict[str, Any] | None:
        """{member: its digest as received} of the members whose digest for ``key`` has come (any value: the
        caller checks it), or None on no answer in ``timeout``."""
        ...


class Group(Protocol):
    name: str

    def start(
        self,
        tensors: Iterable[torch.Tensor],
        info: dict[str, Any],
        matchmaking_s: float,
        scheduled: float | None = None,
        expected: int | None = None,
    ) -> Any:
        """Begin a round in the background; ``info`` is gathered by every member. ``expected``: how many
        members we expect (ourselves included): the group may begin as soon as that many have joined,
        instead of at the end of the matchmaking window. A last round (``is_last_round(info)``) meets only
        other last rounds of the group."""
        ...

    def prematch(
        self, info: dict[str, Any], scheduled: float, matchmaking_s: float, expected: int | None = None
    ) -> Any:
        """Look for members now, for a round whose all-reduce waits for ``trigger`` (``sync.prematch_s``):
        ``info`` is gathered as in ``start``; ``scheduled``: the wall time it is meant to begin at."""
        ...

    def trigger(self, handle: Any, tensors: Iterable[torch.Tensor]) -> Any:
        """A prematched round's tensors: its all-reduce may begin. Returns what ``outcome`` takes."""
        ...

    def cancel(self, handle: Any) -> None:
        """Give up a prematched round that will not be triggered (its members are left without us)."""
        ...

    def outcome(self, handle: Any, timeout: float) -> GroupOutcome: ...

    def formed(self, handle: Any) -> bool:
        """Whether the round begun with ``handle`` has its members (or has ended): matchmaking is over."""
        ...

    def serve(self, tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], meta) -> None:
        """What downloaders of this group get from us: ``tensors``, or (a serving group) what ``tensors()``
        returns when one asks, so that copies served rarely take no memory between downloads."""
        ...

    def close(self) -> None: ...


class GroupTransport(Protocol):
    me: str

    def open(self, name: str, like: Sequence[torch.Tensor]) -> Group: ...

    def open_server(self, name: str, codec: Codec | None = None) -> Group:
        """A group that only serves (never averages): its served tensors may change shape. They travel as
        fp16 (fp32 for the dense weights), or with ``codec`` when given."""
        ...

    def fetch(
        self,
        peer: str,
        name: str,
        timeout: float,
        accept: Callable[[dict[str, Any]], bool] | None = None,
        hold_s: float = 0.0,
    ) -> Served | None:
        """What ``peer`` serves under ``name``, or None on any failure or timeout. ``accept`` (picklable: it
        may run in another process) sees the metadata first: when it refuses it, the tensors do not travel
        (``Served(meta, [])``), so that polling a holder for a fresh copy costs a few bytes, not the copy.
        ``hold_s``: for up to this long (within ``timeout``) the holder answers a refused ask again as soon
        as what it serves changes, so a copy that becomes fresh comes at once instead of at the next poll."""
        ...

    def close_groups(self, groups: Sequence[Group]) -> None:
        """Close groups side by side, within one bounded grace period."""
        ...

    def direct_digests(self) -> DigestExchange:
        """Round digests sent straight to the members of a group (``sync.digests: direct``)."""
        ...
