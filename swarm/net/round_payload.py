"""What a group sends in a round: with a lossy codec, the change since the last agreed state (the outer
gradient) plus what the codec dropped last time; with fp32, the weights themselves.

    payloads = Payloads(codec_named("int8"), error_feedback=True, dense_codec=codec_named("int4"))
    sent = payloads.encode(spec, local, weights)       # SentPayload: tensors for group.start, its reference id
    averages = payloads.decode(spec, sent, averaged)   # {item: reference + mean delta}: the average of weights
    payloads.commit(spec, sent, averages, new_id)      # once every member agreed: the next reference

Each member of a group keeps the group's last agreed result as its reference. A delta is small next to the
weights, so the codec's error is small next to the weights too; and mean(x - r) + r = mean(x) exactly when
every member used the same r. A round short of members that some member expected does not move the reference
on (``round_info.reference_moves``): after a group split, or a round a joiner missed, members' references
would otherwise differ at their next round together. Its change is then part of the next one's. Members name
their reference in their round info: if they differ (a member missed a round, or joined since), the result
is meaningless and every member drops it. In a dense group the members whose reference is the most common
one keep it and the others forget theirs, then take that reference from a member that has it (every member
serves its reference: ``run_round``), so the next round sends changes again. An expert group's members serve
no reference, so all of them forget theirs, and its next round sends weights (against a zero reference) to
start a common one: had the majority kept theirs, every later round of the group would be dropped.

With ``sync.embeddings_every`` the dense weights travel in two groups (all of them, or the core ones), and
each group's agreed result becomes the other's reference for the core weights (``commit``'s ``core``).

Error feedback: a member adds what the codec dropped from its last sent payload to the next one, so
quantisation error is delayed, never lost. The residual is the exact difference between what was encoded and
what a receiver decodes (``Codec.roundtrip`` is what the wire does), kept only once the round is applied.
Both cost one host copy of the group's tensors each; an fp32 run keeps neither. The residual is computed on
first use (``SentPayload.residuals``): ``run_round`` asks for it once its groups have started, so that the
codec's pass over the tensors runs during the all-reduce instead of before matchmaking.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm.config import SyncConfig
from swarm.net.group_layout import CORE, DENSE, GroupSpec, is_dense, pack, sibling, unpack
from swarm.sync.codecs import Codec, codec_named


@dataclass(frozen=True)
class SentPayload:
    tensors: Iterable[torch.Tensor]  # packed (w * (x - r) per item, then the weights), compensated
    reference: str  # the id of the reference the deltas are against; "" for plain weights
    feedback: Codec | None = None  # with error feedback: the codec whose error ``residuals`` is

    @functools.cached_property
    def residuals(self) -> list[torch.Tensor] | None:
        """What the codec drops from ``tensors`` (all but the weights), or None without error feedback."""
        if self.feedback is None:
            return None
        return [t - self.feedback.roundtrip(t) for t in list(self.tensors)[:-1]]


def rebased_id(ref_id: str, core_id: str) -> str:
    """The id of a dense reference whose core weights a core round ``core_id`` replaced: the full round it came
    from (``ref_id``, or the part before "~" of one rebased before) and that core round, hashed short so that
    it stays within what a round info may carry (``round_info.MAX_REFERENCE``)."""
    base = ref_id.split("~")[0] if "~" in ref_id else _short(ref_id)
    return f"{base}~{_short(core_id)}"


def _short(ref_id: str) -> str:
    return hashlib.sha256(ref_id.encode()).hexdigest()[:24]


class Payloads:
    """See the module docstring. Used by the round thread; ``forget`` may come from another thread."""

    def __init__(self, codec: Codec, error_feedback: bool = True, dense_codec: Codec | None = None) -> None:
        """``codec``: the expert groups'; ``dense_codec``: the dense group's (default: ``codec``)."""
        self.codec, self.dense_codec, self.error_feedback = codec, dense_codec or codec, error_feedback
        self._refs: dict[str, tuple[str, dict[str, list[torch.Tensor]]]] = {}
        self._residuals: dict[str, list[torch.Tensor]] = {}
        self._held: dict[str, int] = {}  # rounds applied since the group's reference last moved on
        self._lock = threading.Lock()

    @classmethod
    def for_sync(cls, sync: SyncConfig) -> Payloads:
        """A peer's: ``sync.codec`` for expert groups, ``sync.dense_codec`` (or that) for the dense group."""
        return cls(codec_named(sync.codec), sync.error_feedback, codec_named(sync.dense_codec_name))

    def codec_for(self, spec: GroupSpec) -> Codec:
        return self.dense_codec if is_dense(spec) else self.codec

    @property
    def lossless(self) -> bool:
        """Whether every group's codec is: members' results are then equal, not a codec's error apart."""
        return self.codec.lossless and self.dense_codec.lossless

    def reference(self, spec: GroupSpec) -> tuple[str, dict[str, list[torch.Tensor]] | None]:
        """(id, tensors per item) of the group's agreed reference, or ("", None)."""
        with self._lock:
            ref = self._refs.get(spec.name)
        return ref if ref is not None and set(spec.items) <= set(ref[1]) else ("", None)

    def reference_id(self, spec: GroupSpec) -> str:
        return self.reference(spec)[0]

    def held(self, spec: GroupSpec) -> int:
        """Rounds of the group applied since its reference last moved on (``commit``)."""
        with self._lock:
            return self._held.get(spec.name, 0)

    def adopt(self, spec: GroupSpec, ref_id: str, tensors: Mapping[str, list[torch.Tensor]]) -> None:
        """Take another member's reference (its served copy of the agreed state) as ours."""
        with self._lock:
            self._refs[spec.name] = (ref_id, {i: list(tensors[i]) for i in spec.items})
            self._residuals.pop(spec.name, None)
            self._held.pop(spec.name, None)

    def encode(
        self,
        spec: GroupSpec,
        local: Mapping[str, Sequence[torch.Tensor]],
        weights: Mapping[str, float],
    ) -> SentPayload:
        codec = self.codec_for(spec)
        if codec.lossless:  # one packed tensor at a time into the group's buffers: no extra copy
            return SentPayload(pack(spec, local, weights), "")
        ref_id = self.reference_id(spec)
        with self._lock:
            ref = self._refs[spec.name][1] if ref_id else None
            residual = self._residuals.get(spec.name) if ref_id else None
        if ref is not None:
            local = {i: [x - r for x, r in zip(local[i], ref[i], strict=True)] for i in spec.items}
        tensors = list(pack(spec, local, weights))
        if residual is not None and len(residual) == len(tensors) - 1:
            tensors = [t + e for t, e in zip(tensors, residual, strict=False)] + [tensors[-1]]
        return SentPayload(tensors, ref_id, codec if self.error_feedback else None)

    def decode(
        self, spec: GroupSpec, sent: SentPayload, averaged: list[torch.Tensor], sizes: Mapping[str, int]
    ) -> tuple[dict[str, list[torch.Tensor]], list[float]]:
        """({item: averaged weights}, mean weight per item) from a group's averaged packed tensors."""
        averages, weights = unpack(spec, averaged, sizes)
        if sent.reference:
            with self._lock:
                ref = self._refs[spec.name][1]
            averages = {i: [d + r for d, r in zip(averages[i], ref[i], strict=True)] for i in spec.items}
        return averages, weights

    def commit(
        self,
        spec: GroupSpec,
        sent: SentPayload,
        averages: Mapping[str, list[torch.Tensor]],
        agreed_id: str,
        moves: bool = True,
        core: Sequence[int] = (),
    ) -> None:
        """The round was applied: the codec's error is the next residual, and its result the group's next
        reference if it ``moves`` on (``round_info.reference_moves``); else the next round's changes are
        against the same reference as this one's were (they include this round's change). ``core``: where
        the core dense weights are in the dense ones, when a swarm averages them on their own
        (``sync.embeddings_every``): a dense group's result is then the other one's reference for them too."""
        if self.codec_for(spec).lossless:
            return
        with self._lock:
            if moves:
                self._refs[spec.name] = (agreed_id, {i: [t.clone() for t in averages[i]] for i in spec.items})
                self._held.pop(spec.name, None)
                if core and is_dense(spec):
                    self._rebase_sibling(spec, agreed_id, core)
            else:
                self._held[spec.name] = self._held.get(spec.name, 0) + 1
            if sent.residuals is not None:
                self._residuals[spec.name] = sent.residuals
            else:
                self._residuals.pop(spec.name, None)

    def _rebase_sibling(self, spec: GroupSpec, agreed_id: str, core: Sequence[int]) -> None:
        """After a dense group's reference moved on to ``agreed_id``, its core weights are the agreed state
        of the other dense group's too: the next round of that group sends their change since this round,
        not since its own last one (in int4, a full round's changes of the core weights would otherwise span
        ``embeddings_every`` rounds). Every member that applied the same rounds holds the same ids: a full
        round's core reference is named by that round, the dense reference after a core round by the full
        round it came from and the core round (``rebased_id``)."""
        other, new = sibling(spec), self._refs[spec.name][1]
        if spec.items == (DENSE,):
            self._refs[other.name] = (agreed_id, {CORE: [new[DENSE][i] for i in core]})
        elif other.name in self._refs:
            ref_id, old = self._refs[other.name]
            dense = list(old[DENSE])
            for i, t in zip(core, new[CORE], strict=True):
                dense[i] = t
            self._refs[other.name] = (rebased_id(ref_id, agreed_id), {DENSE: dense})
        else:
            return
        self._held.pop(other.name, None)

    def keep(self, names: Iterable[str]) -> None:
        """Forget the state of groups no longer in the layout (their members changed, or the experts)."""
        keep = set(names)
        with self._lock:
            self._refs = {n: r for n, r in self._refs.items() if n in keep}
            self._residuals = {n: r for n, r in self._residuals.items() if n in keep}
            self._held = {n: r for n, r in self._held.items() if n in keep}

    def forget(self, name: str) -> None:
        """Members did not share a reference, or the group closed: the next round sends weights."""
        with self._lock:
            self._refs.pop(name, None)
            self._residuals.pop(name, None)
            self._held.pop(name, None)
