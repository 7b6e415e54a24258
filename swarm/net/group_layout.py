"""Which tensors are averaged together: the dense weights in one group, and the local experts that have the
same holders in one group each, so that a peer runs a fixed handful of averagers whatever its experts.

    specs, sole = layout("demo", me, local=[0, 1, 2, 3], holders=view.holders)
    tensors = pack(spec, {"expert0": [...], ...}, {"expert0": 2.5, ...})   # w * x per item, then the w's
    averages, weights = unpack(spec, outcome.tensors, sizes)               # sum(w x) / sum(w) per item

Members average with equal weight, so sending w * x and w gives every item its exact token-weighted mean
(mean(w x) / mean(w)), each expert with its own weights inside one group. The weights that arrive back
are also the mean of what the members really sent, which the round compares with what they claimed.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swarm.net.transport import DENSE_SUFFIX, Group, GroupTransport

if TYPE_CHECKING:
    from swarm.net.membership import MembershipView

DENSE = "dense"
# the dense weights but the token embeddings and output head, averaged on their own at the sync points
# between full dense rounds (``sync.embeddings_every``)
CORE = "core"
MAX_NAME = 64


def expert_item(e: int) -> str:
    return f"expert{e}"


def item_expert(item: str) -> int:
    return int(item.removeprefix("expert"))


@dataclass(frozen=True)
class GroupSpec:
    """An averaging group: its name (the same on every member) and its items, in order."""

    name: str
    items: tuple[str, ...]


def experts_group_name(run_id: str, experts: Sequence[int]) -> str:
    name = f"{run_id}_experts_" + "_".join(map(str, sorted(experts)))
    if len(name) > MAX_NAME:  # DHT keys stay short; the hash still names exactly this set
        name = f"{run_id}_experts_{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return name


def layout(
    run_id: str, me: str, local: Sequence[int], holders: Mapping[int, frozenset[str]], full: bool = True
) -> tuple[list[GroupSpec], list[int]]:
    """The dense group (or, not ``full``, the core group: ``sync.embeddings_every``), one group per set of
    local experts with the same holders (as this view sees them), and the experts we hold alone (nothing to
    average; they are only served)."""
    by_holders: dict[frozenset[str], list[int]] = {}
    sole = []
    for e in sorted(local):
        who = frozenset(holders.get(e, frozenset())) | {me}
        if who == {me}:
            sole.append(e)
        else:
            by_holders.setdefault(who, []).append(e)
    specs = [dense_spec(run_id) if full else core_spec(run_id)]
    for experts in sorted(by_holders.values()):
        specs.append(GroupSpec(experts_group_name(run_id, experts), tuple(map(expert_item, experts))))
    return specs, sole


def pack(
    spec: GroupSpec, tensors: Mapping[str, Sequence[torch.Tensor]], weights: Mapping[str, float]
) -> Iterator[torch.Tensor]:
    """w * x for each item's tensors, one at a time (the caller copies each into its buffer), then the
    vector of weights."""
    for item in spec.items:
        for t in tensors[item]:
            yield t * weights[item]
    yield torch.tensor([float(weights[item]) for item in spec.items], dtype=torch.float32)


def packed_like(spec: GroupSpec, like: Mapping[str, Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Host fp32 buffers of the packed shapes."""
    out = [torch.zeros(t.shape, dtype=torch.float32) for item in spec.items for t in like[item]]
    return [*out, torch.zeros(len(spec.items), dtype=torch.float32)]


def unpack(
    spec: GroupSpec, tensors: list[torch.Tensor], sizes: Mapping[str, int]
) -> tuple[dict[str, list[torch.Tensor]], list[float]]:
    """({item: sum(w x) / sum(w)}, mean weight per item) from an averaged packed list (divided in place)."""
    weights = [float(w) for w in tensors[-1]]
    out, i = {}, 0
    for item, w in zip(spec.items, weights, strict=True):
        part = tensors[i : i + sizes[item]]
        i += sizes[item]
        if w > 0:
            for t in part:
                t.div_(w)
        out[item] = part
    if i != len(tensors) - 1:
        raise ValueError(f"{spec.name}: {len(tensors)} tensors do not match the group's items")
    return out, weights


def served_items(meta: Mapping, tensors: list[torch.Tensor], per_item: int) -> dict[str, list]:
    """Split what a peer serves into its items (``meta["items"]`` names them in order, ``per_item`` tensors
    each: every expert has the same count); {} if malformed."""
    items = meta.get("items") if isinstance(meta, Mapping) else None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        return {}
    if per_item * len(items) != len(tensors) or len(set(items)) != len(items):
        return {}
    return {item: tensors[k * per_item : (k + 1) * per_item] for k, item in enumerate(items)}


def served_dense(spec: GroupSpec, meta: Mapping, tensors: list[torch.Tensor], n: int) -> list | None:
    """The dense weights (``n`` tensors, fp32) from what a peer's dense group serves (its packed layout,
    weight 1), or None if it serves something else."""
    if not isinstance(meta, Mapping) or meta.get("items") != [DENSE] or len(tensors) != n + 1:
        return None
    try:  # the weights tensor comes from another peer too: any shape
        return unpack(spec, [t.float() for t in tensors], {DENSE: n})[0][DENSE]
    except (ValueError, TypeError, RuntimeError):
        return None


class OpenGroups:
    """The groups this peer has open, by name: opened on first use, reused round after round, and closed
    when a new layout no longer needs them (between rounds)."""

    def __init__(self, transport: GroupTransport) -> None:
        self.transport = transport
        self._open: dict[str, Group] = {}
        self._lock = threading.Lock()  # the round thread opens, the training thread retires

    def get(self, spec: GroupSpec, like: Mapping[str, Sequence[torch.Tensor]]) -> Group:
        with self._lock:
            group = self._open.get(spec.name)
        if group is None:  # opening may take a second (hivemind starts a process): outside the lock
            group = self.transport.open(spec.name, packed_like(spec, like))
            with self._lock:
                self._open[spec.name] = group
        return group

    def retire(self, keep: set[str]) -> list[Group]:
        """Remove and return the groups not named in ``keep`` (the caller closes them)."""
        with self._lock:
            gone = [name for name in self._open if name not in keep]
            return [self._open.pop(name) for name in gone]

    def take_all(self) -> list[Group]:
        with self._lock:
            groups, self._open = list(self._open.values()), {}
        return groups


def dense_spec(run_id: str) -> GroupSpec:
    """The dense weights' group of a run."""
    return GroupSpec(f"{run_id}{DENSE_SUFFIX}", (DENSE,))


def core_spec(run_id: str) -> GroupSpec:
    """The core dense weights' group of a run (its name ends as the dense group's: transports average it in
    the dense codec)."""
    return GroupSpec(f"{run_id}_{CORE}{DENSE_SUFFIX}", (CORE,))


def sibling(spec: GroupSpec) -> GroupSpec:
    """The run's other dense group: the core one of the dense one, and back."""
    if spec.items == (DENSE,):
        return core_spec(spec.name.removesuffix(DENSE_SUFFIX))
    return dense_spec(spec.name.removesuffix(f"_{CORE}{DENSE_SUFFIX}"))


def dense_group_names(run_id: str) -> set[str]:
    """Both dense groups' names: a round opens one of them, and the other keeps its state meanwhile."""
    return {dense_spec(run_id).name, core_spec(run_id).name}


def is_dense(spec: GroupSpec) -> bool:
    """Whether a group averages dense weights (all of them, or the core): every peer that trains is a
    member, not only some expert's holders."""
    return spec.items in ((DENSE,), (CORE,))


def expected_members(spec: GroupSpec, view: MembershipView, me: str, last: bool = False) -> int:
    """How many members the group should have in our round (a ``last`` one or not), as our view sees it
    (ourselves included)."""
    if is_dense(spec):
        return 1 + len(view.partners(me, ordinary=not last))
    return len(
        frozenset.intersection(*(view.holders.get(item_expert(i), frozenset()) | {me} for i in spec.items))
    )


def reference_quorum(spec: GroupSpec, view: MembershipView, me: str) -> int:
    """How many members an ordinary round of the group needs for a lossy codec's reference to move on to its
    result (``round_payload``), as our view sees it: every peer that trains, or will once it has caught up,
    the group's items (ourselves included)."""
    if is_dense(spec):
        return 1 + len(view.partners(me, ordinary=True, joining=True))
    return expected_members(spec, view, me)
