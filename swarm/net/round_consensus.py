"""Detecting partial rounds: all members of a group must end with the same tensors.

hivemind can report success when a peer died mid-round and part of a tensor was never averaged (NOTES.md:
12% true mean, 29% 2-peer mean, 57% untouched). Every member therefore publishes a digest of its result
under a key derived from the group (its members and their round info), sends it to the other members
(``DigestExchange``: through the DHT, ``StoreDigests``, or straight to them, ``direct_digests``), waits for
theirs, and applies the result only if all digests agree and every member reported, or a majority of at
least two agree and the rest differ or stayed silent for a grace period. An untouched part makes digests
disagree: a member that died mid-round left its share untouched, so the survivors' results differ (no two
agree), and in a group of two the one left alone waits for a digest that never comes; either way the round
is dropped by everyone. A member that withholds its digest, or publishes one of a result of its own (a
rogue that sent NaN ends with NaN), no longer vetoes a round of three or more: the majority applies it.
A silent member whose heartbeat has stopped too (``gone``: killed, or its machine lost) cannot side with
anyone any more: the members do not wait for it until the round's deadline.

The digest is, for each segment of each tensor, its sum of magnitudes and one fixed random projection (a
pattern of signs, repeated): insensitive to last-bit rounding (members add deltas in a different order),
sensitive to any part left unaveraged.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import torch

from swarm.net.records import finite_number
from swarm.net.transport import DigestExchange, Store

SEGMENTS = 16
MAX_PAIRS = 96
SIGN_PERIOD = 1 << 16  # the projection's sign pattern repeats every this many values
SIGN_SEED = 20260226
REL_TOLERANCE = 1e-4
QUORUM_GRACE_S = 3.0  # how long a majority waits for the silent members' digests
RETRY_S = 0.2  # between tries to store a digest
FIRST_POLL_S = 0.02  # the first wait for the others' digests; it doubles up to ``poll``
# what a member whose side of the all-reduce failed sends as its digest (``round_checks.tell_failed``): it
# agrees with no result, so the others count it at once as a member whose result differs
FAILED_DIGEST: list[float] = []


def group_key(run_id: str, prefix: str, members: dict[str, dict[str, Any]]) -> str:
    # a member's info is what it sent: keys of any msgpack type (sorted as text, never compared raw)
    infos = ((peer, sorted(info.items(), key=lambda kv: repr(kv[0]))) for peer, info in members.items())
    blob = msgpack.packb(sorted(infos, key=lambda pi: pi[0]))
    return f"{run_id}_digest_{prefix}_{hashlib.sha256(blob).hexdigest()[:24]}"


def abs_sums(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Per slot, the sum of |x|: ``digest(tensors)[0::2]`` without the projections (``digests_agree``'s
    floor)."""
    return _fold(tensors, signed=False)[0::2]


def digest(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Per tensor and per segment: (sum of |x|, a signed random projection), folded into at most
    ``MAX_PAIRS`` pairs (slot = segment number mod MAX_PAIRS) so that a record stays small whatever the
    number of tensors (hivemind refuses values of a few KB)."""
    return _fold(tensors, signed=True)


def _fold(tensors: Sequence[torch.Tensor], signed: bool) -> list[float]:
    pairs: list[list[float]] = []
    for i, t in enumerate(tensors):
        for j, pair in enumerate(_segment_sums(t, signed)):
            slot = (i * SEGMENTS + j) % MAX_PAIRS
            if slot == len(pairs):
                pairs.append([0.0, 0.0])
            pairs[slot][0] += pair[0]
            pairs[slot][1] += pair[1]
    return [x for pair in pairs for x in pair]


@functools.cache
def _signs() -> torch.Tensor:
    """The projection's fixed pattern of +-1, ``SIGN_PERIOD`` long, the same on every peer."""
    gen = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (SIGN_PERIOD,), generator=gen, dtype=torch.float32).mul_(2).sub_(1)


def _segment_sums(t: torch.Tensor, signed: bool) -> list[list[float]]:
    """[sum of |x|, sum of x times the sign pattern repeated from the segment's start (0.0 unless
    ``signed``)] for each of the ``SEGMENTS`` segments of ``t.tensor_split(SEGMENTS)`` (flattened).

    The segments are taken as the rows of two matrices (the first ``n % SEGMENTS`` one value longer), so a
    tensor costs a dozen torch ops, not a dozen per segment: a round's digest runs on the thread of a
    process that trains, where each op gives up the GIL and waits to get it back (``round_cpu.py``). A row's
    projection is summed in float32 a pattern's length at a time (matrix-vector products), then in float64.
    """
    flat = t.detach().reshape(-1).float()
    q, r = divmod(flat.numel(), SEGMENTS)
    out: list[list[float]] = []
    for rows in (flat[: r * (q + 1)].view(r, q + 1), flat[r * (q + 1) :].view(SEGMENTS - r, q)):
        if rows.shape[0] == 0:
            continue
        mags = rows.abs().sum(dim=1, dtype=torch.float64)
        proj = torch.zeros_like(mags)
        length = rows.shape[1]
        if signed and length:
            signs, whole = _signs(), length // SIGN_PERIOD * SIGN_PERIOD
            if whole:
                blocks = rows[:, :whole].reshape(rows.shape[0], whole // SIGN_PERIOD, SIGN_PERIOD)
                proj += (blocks @ signs).sum(dim=1, dtype=torch.float64)
            if length > whole:
                proj += (rows[:, whole:] * signs[: length - whole]).sum(dim=1, dtype=torch.float64)
        out += torch.stack([mags, proj], dim=1).tolist()
    return out


def digests_agree(
    a: Sequence[float],
    b: Sequence[float],
    tolerance: float = REL_TOLERANCE,
    floor: Sequence[float] | None = None,
) -> bool:
    """Whether two digests agree within ``tolerance`` of each segment's sum of |x|, plus ``floor`` (per
    segment: the sums of |x| of what we sent, when members' results may differ by the codec's error of
    mean - own, which can exceed the mean when the members' changes cancel out)."""
    if len(a) != len(b) or len(a) % 2 or not all(finite_number(x) for x in (*a, *b)):
        return False  # another peer's digest may be anything (a NaN would agree with every digest)
    if floor is not None and len(floor) * 2 != len(a):
        return False
    for i in range(0, len(a), 2):
        # sums of |x| bound every projection of the segment
        scale = abs(a[i]) + abs(b[i]) + (floor[i // 2] if floor is not None else 0.0) + 1e-12
        if abs(a[i] - b[i]) > tolerance * scale or abs(a[i + 1] - b[i + 1]) > tolerance * scale:
            return False
    return True


def _differs(differ: list[str], seen: dict, missing: int, mine: list[float]) -> str:
    """Why a round is dropped for differing digests: who, and whether the digests were finite numbers."""
    failed = [p for p in differ if seen[p] == FAILED_DIGEST]
    odd = sum(1 for p in differ if not (isinstance(seen[p], list) and all(finite_number(x) for x in seen[p])))
    own = "" if all(finite_number(x) for x in mine) else "; ours is not finite"
    return (f"partial round: result differs from {', '.join(p[-8:] for p in differ)}"
            + (f" ({len(failed)} failed on their side)" if failed else "")
            + (f" ({odd} not finite)" if odd else "") + (f", {missing} silent" if missing else "") + own)  # fmt: skip


def _majority(k: int, n: int) -> bool:
    """Whether ``k`` of ``n`` members are a majority that may apply a round: two at least."""
    return k >= 2 and 2 * k > n


def publish_digest(store: Store, key: str, me: str, mine: list[float], timeout: float) -> bool:
    """Store our digest under ``key``; whether it was stored within ``timeout``. A store that failed is
    tried again while time is left: one digest that fails to land costs every member the round, and a
    lossy codec's next round too (the member that missed it keeps an older reference)."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if store.put(key, mine, store.now() + 60 + timeout, subkey=me, timeout=left):
            return True
        if end - time.monotonic() < RETRY_S:
            return False
        time.sleep(RETRY_S)


class StoreDigests:
    """Digests as records in the ``Store``: ours under our own subkey of the group's key, the others' read
    back from it. A store that is refused is tried again while time is left (``publish_digest``)."""

    poll_s = 0.25  # every look is a DHT lookup

    def __init__(self, store: Store, me: str) -> None:
        self.store, self.me = store, me

    def publish(self, key: str, digest: list[float], members: Sequence[str], timeout: float) -> bool:
        return publish_digest(self.store, key, self.me, digest, timeout)

    def collect(self, key: str, members: Sequence[str], timeout: float) -> dict[str, Any] | None:
        found = self.store.get_subkeys(key, timeout=timeout)
        return None if found is None else {p: v for p, (v, _) in found.items() if p in members}


def await_digests(
    exchange: DigestExchange,
    key: str,
    me: str,
    members: Sequence[str],
    mine: list[float],
    timeout: float,
    tolerance: float = REL_TOLERANCE,
    floor: Sequence[float] | None = None,
    poll: float | None = None,
    grace: float = QUORUM_GRACE_S,
    gone: Callable[[str], bool] = lambda peer: False,
) -> tuple[bool, str]:
    """Wait until every other member's digest is in and agrees with ours (within the codec's
    ``tolerance``), or a majority of at least two members agree and the others differ or stayed silent
    ``grace`` seconds since. Returns (ok, reason); a reason with ok says who was out-voted or missing.
    ``gone(peer)``: whether a member has stopped publishing heartbeats (its digest will never come);
    ``poll``: the longest wait between looks (None: the exchange's ``poll_s``)."""
    deadline = time.monotonic() + timeout
    others = set(members) - {me}
    quorum_since = dissent_since = None
    # members publish within a few tens of ms of each other when their all-reduces end together: look
    # again soon, then less often (``poll``)
    poll = exchange.poll_s if poll is None else poll
    wait = min(FIRST_POLL_S, poll)
    while True:
        found = exchange.collect(key, members, timeout=max(0.1, deadline - time.monotonic())) or {}
        seen = {peer: value for peer, value in found.items() if peer in others}
        differ = sorted(
            p
            for p, v in seen.items()
            if not isinstance(v, list) or not digests_agree(mine, v, tolerance, floor)
        )
        missing = others - set(seen)
        if not differ and not missing:
            return True, ""
        dead = {p for p in missing if gone(p)}
        agreeing, n = 1 + len(seen) - len(differ), len(others) + 1
        if not _majority(agreeing + len(missing - dead), n):  # out-voted, or no majority can form any more
            if differ:
                return False, _differs(differ, seen, len(missing), mine)
            return False, f"partial round: no digest from {len(missing)} member(s)" + (
                f" ({len(dead)} without a heartbeat since, or done with that round)" if dead else ""
            )
        if differ and not _majority(agreeing, n):
            # a member that dropped out mid-round leaves the others' results differing and its own digest
            # missing: waiting for it to side with us past the grace period would stall the round
            dissent_since = time.monotonic() if dissent_since is None else dissent_since
            if time.monotonic() - dissent_since >= grace:
                return False, _differs(differ, seen, len(missing), mine)
        if _majority(agreeing, n):
            quorum_since = time.monotonic() if quorum_since is None else quorum_since
            if not missing - dead or time.monotonic() - quorum_since >= min(
                grace, max(0.0, deadline - quorum_since)
            ):
                why = [f"{len(differ)} differ" if differ else "", f"{len(missing)} silent" if missing else ""]
                return True, f"applied by a majority: member(s) {' and '.join(w for w in why if w)}"
        if time.monotonic() >= deadline:
            return False, f"partial round: no digest from {len(missing)} member(s)"
        time.sleep(wait)
        wait = min(2 * wait, poll)
