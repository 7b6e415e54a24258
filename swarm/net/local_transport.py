"""An in-memory ``Store`` and ``GroupTransport`` for peers in one process, with a fault plan.

    net = LocalNetwork(matchmaking_s=0.3, faults=[Fault("nan", peer="b", round=2)], codec=codec_named("int8"),
                       rule=aggregation_rule("centered_trim"))
    store, transport = net.store("a"), net.transport("a")     # one pair per simulated peer

Groups form like hivemind's: members that start a round under the same name within the matchmaking window
(from the first start, or at the scheduled time; a round that asks for a shorter window than the network's
gets it) form one group, last rounds apart from ordinary ones; at least two make a round. The average is the
plain mean of what members sent, or the ``rule``'s aggregate (applied to each whole tensor, where hivemind's
reducers apply it to each streamed part), through the codec as hivemind's butterfly all-reduce does it: each
member's share travels encoded to its reducer, and each member gets (mean - its own) back encoded, except in
the share it reduced itself. Faults (``Fault.kind``), each at a chosen round of a chosen peer:

- ``drop``: the peer leaves mid-all-reduce: it fails, and the others keep their own values in the share
  that the peer was reducing (the partial result hivemind reports as success);
- ``partial``: only the peer's result keeps its own values in one share (its copy differs from the rest);
- ``failed``: the peer's side of the all-reduce fails once its group formed (as a hivemind sender that timed
  out), knowing the group's members, while the others' results are whole;
- ``nan``: the peer sends NaN;
- ``scale``: the peer sends its tensors times ``factor`` (a weight it did not claim);
- ``delay``: the peer's outcome comes ``seconds`` late (past its timeout, it is abandoned);
- ``silent``: the peer publishes no round digest (in any round: give no ``round``);
- ``dead``: nobody can download from the peer;
- ``slow``: a download from the peer takes ``seconds`` (a slow link);
- ``garble``: what the peer serves comes with malformed metadata;
- ``unheld``: the peer answers every download at once, also one asked to wait for a new copy (``hold_s``).

Following torchft's fault-injecting process group: tests of the protocol rules run in seconds, with no
processes, sockets or sleeps on the wall clock beyond the windows they configure.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.net.round_consensus import StoreDigests
from swarm.net.served_prints import kept_prints
from swarm.net.transport import GroupOutcome, Served, is_dense_group, is_last_round, metadata_accepted
from swarm.sync.codecs import CODECS, Codec
from swarm.sync.robust_mean import AggregationRule


@dataclass(frozen=True)
class Fault:
    kind: str  # drop | partial | failed | nan | scale | delay | silent | dead | slow | garble | unheld
    peer: str
    round: int | None = None  # the round index in the members' info; None: every round
    seconds: float = 0.0  # delay, slow
    factor: float = 1.0  # scale


POLL_S = 0.02  # how often a waiting member looks whether its group has formed


@dataclass
class _Formation:
    closes_at: float
    codec: Codec
    sent: dict[str, tuple[list[torch.Tensor], dict[str, Any]]] = field(default_factory=dict)
    results: dict[str, GroupOutcome] | None = None


class LocalNetwork:
    """The shared medium of in-process peers: one record store, group formations and served copies."""

    def __init__(
        self,
        matchmaking_s: float = 0.3,
        faults: Sequence[Fault] = (),
        codec: Codec = CODECS["fp32"],
        rule: AggregationRule | None = None,
        dense_codec: Codec | None = None,
    ) -> None:
        self.matchmaking_s, self.faults, self.codec, self.rule = matchmaking_s, list(faults), codec, rule
        self.dense_codec = dense_codec or codec  # the dense group's (``is_dense_group``)
        self.lock = threading.Lock()
        self.served_changed = threading.Condition(self.lock)  # held fetches wait on it (``hold_s``)
        self.records: dict[str, dict[str | None, tuple[Any, float]]] = {}
        self.forming: dict[tuple[str, bool], _Formation] = {}
        self.served: dict[tuple[str, str], Served] = {}
        self.lazy: dict[tuple[str, str], tuple[Callable[[], Sequence[torch.Tensor]], Codec | None]] = {}
        self.closed_groups: list[str] = []
        self.server_codecs: dict[str, Codec | None] = {}
        self.fetched: list[tuple[str, str, str, int]] = []  # (who, from whom, name, values served)

    def store(self, me: str) -> LocalStore:
        return LocalStore(self, me)

    def transport(self, me: str) -> LocalTransport:
        return LocalTransport(self, me)

    def fault(self, kind: str, peer: str, info: dict[str, Any] | None = None) -> Fault | None:
        index = info.get("round") if isinstance(info, dict) else None
        for f in self.faults:
            if f.kind == kind and f.peer == peer and (f.round is None or f.round == index):
                return f
        return None

    # -- groups ---------------------------------------------------------------------------------------------
    def join(
        self, name: str, me: str, tensors: list[torch.Tensor] | None, info: dict, scheduled: float | None,
        expected: int | None = None, look_s: float | None = None,
    ):  # fmt: skip
        key = (name, is_last_round(info))  # as hivemind's group key: last rounds meet only each other
        with self.lock:
            form = self.forming.get(key)
            if form is None or form.results is not None or time.time() >= form.closes_at:
                window = self.matchmaking_s if look_s is None else min(self.matchmaking_s, look_s)
                closes = scheduled if scheduled is not None else time.time() + window
                codec = self.dense_codec if is_dense_group(name) else self.codec
                form = self.forming[key] = _Formation(closes, codec)
            form.sent[me] = (tensors, info)
            if expected is not None and len(form.sent) >= expected:  # complete: it begins now
                form.closes_at = min(form.closes_at, time.time())
            return form

    def close(self, form: _Formation) -> None:
        with self.lock:
            if form.results is not None:
                return
            # a prematched member that never gave its tensors (``LocalGroup.trigger``) is left out
            members = sorted(m for m, (tensors, _) in form.sent.items() if tensors is not None)
            if len(members) < 2:
                form.results = {m: GroupOutcome(False, "no group formed") for m in members}
                return
            sent = {m: self._sent(m, *form.sent[m]) for m in members}
            received = [[form.codec.roundtrip(t) for t in ts] for ts in sent.values()]
            reduce = self.rule or (lambda stacked: stacked.mean(0))
            mean = [reduce(torch.stack(ts)) for ts in zip(*received, strict=True)]
            infos = {m: form.sent[m][1] for m in members}
            form.results = {}
            dropped = [m for m in members if self.fault("drop", m, infos[m])]
            for k, m in enumerate(members):
                result = [t.clone() for t in mean]
                if not form.codec.lossless:  # what comes back is encoded, but for the share it reduced
                    result = [o + form.codec.roundtrip(a - o) for a, o in zip(mean, sent[m], strict=True)]
                    _keep_share(result, mean, k, len(members))
                if m in dropped:
                    form.results[m] = GroupOutcome(False, "left during the all-reduce")
                    continue
                if self.fault("failed", m, infos[m]):
                    form.results[m] = GroupOutcome(
                        False, "partial all-reduce: a sender timed out", members=infos
                    )
                    continue
                for j, other in enumerate(members):  # shares reduced by a member that left stay ours
                    if other in dropped or (other == m and self.fault("partial", m, infos[m])):
                        _keep_share(result, sent[m], j, len(members))
                form.results[m] = GroupOutcome(True, tensors=result, members=infos)

    def _sent(self, me: str, tensors: list[torch.Tensor], info: dict) -> list[torch.Tensor]:
        if self.fault("nan", me, info):
            return [torch.full_like(t, float("nan")) for t in tensors]
        scale = self.fault("scale", me, info)
        return [t * scale.factor for t in tensors] if scale else tensors


def _all_triggered(form: _Formation) -> bool:
    return all(tensors is not None for tensors, _ in form.sent.values())


def _keep_share(result: list[torch.Tensor], own: list[torch.Tensor], share: int, n: int) -> None:
    """In place: the ``share``-th of ``n`` slices of every tensor takes our own (unaveraged) values."""
    for r, o in zip(result, own, strict=True):
        flat_r, flat_o = r.view(-1), o.reshape(-1)
        size = -(-flat_r.numel() // n)
        flat_r[share * size : (share + 1) * size] = flat_o[share * size : (share + 1) * size]


class LocalStore:
    """See the module docstring."""

    def __init__(self, net: LocalNetwork, me: str) -> None:
        self.net, self.me = net, me

    def now(self) -> float:
        return time.time()

    def put(
        self, key: str, value: Any, expires_at: float, subkey: str | None = None, timeout: float = 10.0
    ) -> bool:
        if subkey is not None and subkey != self.me:  # like hivemind's signed subkeys (HivemindStore)
            raise ValueError(f"a peer writes its own subkey only ({self.me}, not {subkey})")
        if "_digest_" in key and self.net.fault("silent", self.me, {}):
            return True  # claims to have published, like a member that withholds its digest
        with self.net.lock:
            entries = self.net.records.setdefault(key, {})
            old = entries.get(subkey)
            if old is None or old[1] <= expires_at:  # like hivemind: a store that expires sooner is ignored
                entries[subkey] = (value, expires_at)
        return True

    def _live(self, key: str) -> dict[str | None, tuple[Any, float]]:
        now = time.time()
        with self.net.lock:
            return {k: v for k, v in self.net.records.get(key, {}).items() if v[1] > now}

    def get(self, key: str, timeout: float = 10.0) -> Any | None:
        found = self._live(key).get(None)
        return None if found is None else found[0]

    def get_subkeys(self, key: str, timeout: float = 10.0) -> dict[str, tuple[Any, float]] | None:
        return {k: v for k, v in self._live(key).items() if isinstance(k, str)}


class LocalGroup:
    """A ``Group`` of one peer on a ``LocalNetwork``."""

    def __init__(
        self, net: LocalNetwork, me: str, name: str, serves_only: bool, codec: Codec | None = None
    ) -> None:
        self.net, self.me, self.name, self.serves_only, self.codec = net, me, name, serves_only, codec
        self.closed = False

    def serve(self, tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], meta) -> None:
        with self.net.lock:
            self.net.served_changed.notify_all()  # woken once the lock is let go, with the new copy served
            if callable(tensors):  # made when a downloader asks (``Group.serve``)
                self.net.lazy[(self.me, self.name)] = (tensors, self.codec)
                self.net.served[(self.me, self.name)] = Served(dict(meta), [])
                return
            self.net.lazy.pop((self.me, self.name), None)
            served = [t.clone() if self.codec is None else self.codec.roundtrip(t) for t in tensors]
            self.net.served[(self.me, self.name)] = Served(dict(meta), served)  # as they will arrive

    def start(
        self, tensors: Iterable[torch.Tensor], info: dict[str, Any], matchmaking_s: float, scheduled=None,
        expected: int | None = None,
    ):  # fmt: skip
        with self.net.lock:
            self._stop_serving()
        copies = [t.detach().clone() for t in tensors]
        return self.net.join(self.name, self.me, copies, info, scheduled, expected, matchmaking_s)

    def _stop_serving(self) -> None:
        # like hivemind's buffers: nothing served while a round runs, but the prints (the caller locks)
        before = self.net.served.pop((self.me, self.name), None)
        if before is not None and "prints" in before.meta:
            self.net.served[(self.me, self.name)] = Served(kept_prints(before.meta), [])

    def prematch(
        self, info: dict[str, Any], scheduled: float, matchmaking_s: float, expected: int | None = None
    ) -> _Formation:
        return self.net.join(self.name, self.me, None, info, scheduled, expected)

    def trigger(self, handle: _Formation, tensors: Iterable[torch.Tensor]) -> _Formation:
        copies = [t.detach().clone() for t in tensors]
        with self.net.lock:
            self._stop_serving()
            if handle.results is None:
                handle.sent[self.me] = (copies, handle.sent[self.me][1])
        return handle

    def cancel(self, handle: _Formation) -> None:
        with self.net.lock:
            if handle.results is None:
                handle.sent.pop(self.me, None)

    def formed(self, handle: _Formation) -> bool:
        return time.time() >= handle.closes_at

    def outcome(self, handle: _Formation, timeout: float) -> GroupOutcome:
        deadline = time.monotonic() + timeout
        delay = self.net.fault("delay", self.me, handle.sent.get(self.me, (None, None))[1])
        extra = delay.seconds if delay else 0.0
        # the formation may close early (``expected``), and a prematched one once every member has given
        # its tensors (or the round's time is up): look again every POLL_S
        while (left := handle.closes_at + extra - time.time()) > 0 or not _all_triggered(handle):
            if time.monotonic() >= deadline:
                if left <= 0:
                    break  # the members that gave their tensors average without the others
                return GroupOutcome(False, f"TimeoutError: no result within {timeout:.1f} s")
            time.sleep(min(POLL_S, left if left > 0 else POLL_S, max(0.0, deadline - time.monotonic())))
        self.net.close(handle)
        formed_at = time.monotonic() - max(0.0, time.time() - handle.closes_at)
        return dataclasses.replace(handle.results[self.me], formed_at=formed_at)

    def close(self) -> None:
        self.closed = True
        with self.net.lock:
            self.net.closed_groups.append(self.name)


class LocalTransport:
    """See the module docstring."""

    def __init__(self, net: LocalNetwork, me: str) -> None:
        self.net, self.me = net, me
        self.opened: list[str] = []

    def open(self, name: str, like: Sequence[torch.Tensor]) -> LocalGroup:
        self.opened.append(name)
        return LocalGroup(self.net, self.me, name, serves_only=False)

    def open_server(self, name: str, codec: Codec | None = None) -> LocalGroup:
        self.opened.append(name)
        self.net.server_codecs[name] = codec
        return LocalGroup(self.net, self.me, name, serves_only=True, codec=codec)

    def fetch(
        self,
        peer: str,
        name: str,
        timeout: float,
        accept: Callable[[dict[str, Any]], bool] | None = None,
        hold_s: float = 0.0,
    ) -> Served | None:
        if self.net.fault("dead", peer):
            return None
        slow = self.net.fault("slow", peer)
        if slow is not None:
            time.sleep(min(slow.seconds, timeout))
        garbled, held = self.net.fault("garble", peer), 0.0
        with self.net.lock:
            before = self.net.served.get((peer, name))
            refused = accept is not None and (before is None or not metadata_accepted(accept, before.meta))
            if refused and hold_s > 0 and not self.net.fault("unheld", peer):  # as a hivemind holder holds
                began = time.monotonic()
                changed = lambda: self.net.served.get((peer, name)) is not before  # noqa: E731
                if self.net.served_changed.wait_for(changed, timeout=min(hold_s, timeout)):
                    held = time.monotonic() - began
            served, lazy = self.net.served.get((peer, name)), self.net.lazy.get((peer, name))
            if (
                served is not None
                and lazy is not None
                and metadata_accepted(accept or (lambda _: True), served.meta)
            ):
                make, codec = lazy
                tensors = [t.detach().cpu().clone() if codec is None else codec.roundtrip(t) for t in make()]
                served = Served(served.meta, tensors)
            if served is not None and garbled:
                served = Served({"items": "expert0", "steps": [0], "base": 5, "hash": None}, served.tensors)
            if served is not None and accept is not None and not metadata_accepted(accept, served.meta):
                served = Served(dict(served.meta), [])  # like hivemind's: the metadata came, the tensors not
            self.net.fetched.append(
                (self.me, peer, name, sum(t.numel() for t in served.tensors) if served else 0)
            )
        if served is None:
            return Served({}, [])  # it answers, but serves nothing (yet)
        if garbled:
            return Served(dict(served.meta), list(served.tensors))
        # like hivemind's transport: expert copies travel as fp16, or with the server's codec
        half = not is_dense_group(name) and self.net.server_codecs.get(name) is None
        tensors = [t.half() if half else t.clone() for t in served.tensors]
        return Served(dict(served.meta), tensors, held if tensors else 0.0)

    def close_groups(self, groups: Sequence[LocalGroup]) -> None:
        for g in groups:
            g.close()

    def direct_digests(self) -> StoreDigests:
        # in one process a record in the shared store reaches the members as directly as a message would
        return StoreDigests(self.net.store(self.me), self.me)
