"""Prints of every copy a peer holds, served with its dense weights, so that a joiner can check what one
peer gives it against what the others hold.

    meta |= served_prints(dense, {e: expert_tensors(model, e) for e in range(E)}, step, copy_steps)
    # meta["prints"]: {item: print bytes, ~1 KB each}; meta["print_steps"]: {item: the step it is from}
    views = gather_prints(transport, "demo_dense", peers, timeout=5.0)   # PrintViews, metadata only
    views = dataclasses.replace(views, lr=3e-3)   # the peers' peak learning rate
    why = views.doubt("expert3", "<the holder offering it>", offered, step=130)   # "" when plausible

A holder serves its own experts; every other peer holds a copy of them as of its last refresh, and every
peer the dense weights as of its last round. The coordinate-wise median of the other peers' prints is what
the swarm holds; an offered copy far from it (``copy_doubt``) was negated, zeroed or scaled by whoever
served it. How far off it may be grows with the steps between the offered copy and the copies printed
(``norm_factor``): on GPUs a peer's copy can be hundreds of steps older than a holder's. What peers serve
may be anything: malformed prints and steps are left out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from swarm.net.group_layout import DENSE, MAX_NAME, expert_item
from swarm.net.transport import GroupTransport
from swarm.sync.copy_prints import (
    copy_doubt,
    copy_print,
    median_print,
    norm_factor,
    print_bytes,
    print_from_bytes,
    rms,
)

MAX_PRINTS = 4096  # items in one peer's prints: far above any model's experts + 1
PRINT_KEYS = ("prints", "print_steps")


def served_prints(
    dense: Sequence[torch.Tensor],
    experts: Mapping[int, Sequence[torch.Tensor]],
    step: int | None = None,
    copy_steps: Mapping[int, int] | None = None,
) -> dict[str, dict]:
    """The metadata keys that serve prints: ``prints`` {item: print bytes} of the dense weights and every
    expert copy given (local or not), and, given our ``step``, ``print_steps`` {item: the step that copy is
    from}: ``copy_steps`` for the non-local copies that have one, ``step`` for the rest."""
    prints = {DENSE: print_bytes(copy_print(dense))}
    prints |= {expert_item(e): print_bytes(copy_print(ts)) for e, ts in sorted(experts.items())}
    if step is None:
        return {"prints": prints}
    steps = {DENSE: step} | {expert_item(e): (copy_steps or {}).get(e, step) for e in experts}
    return {"prints": prints, "print_steps": steps}


def kept_prints(meta: Mapping) -> dict:
    """What a group keeps serving of ``meta`` while a round holds its buffers: the prints and their steps."""
    return {k: meta[k] for k in PRINT_KEYS if k in meta}


def read_prints(meta: object) -> dict[str, torch.Tensor]:
    """The well-formed prints in a peer's served metadata ({} if none)."""
    raw = meta.get("prints") if isinstance(meta, Mapping) else None
    if not isinstance(raw, Mapping) or len(raw) > MAX_PRINTS:
        return {}
    out = {}
    for item, blob in raw.items():
        p = print_from_bytes(blob)
        if isinstance(item, str) and len(item) <= MAX_NAME and p is not None:
            out[item] = p
    return out


def read_print_steps(meta: object) -> dict[str, int]:
    """The well-formed steps of a peer's printed copies (``print_steps``; {} if none)."""
    raw = meta.get("print_steps") if isinstance(meta, Mapping) else None
    if not isinstance(raw, Mapping) or len(raw) > MAX_PRINTS:
        return {}
    return {
        item: step
        for item, step in raw.items()
        if isinstance(item, str) and len(item) <= MAX_NAME and type(step) is int and step >= 0
    }


def metadata_only(_meta: dict) -> bool:
    return False  # ``GroupTransport.fetch``'s ``accept``: the copy itself never travels


def gather_metadata(
    transport: GroupTransport, name: str, peers: Sequence[str], timeout: float
) -> dict[str, dict]:
    """{peer: the metadata it serves under group ``name``} of the peers that answer, asked at once."""
    if not peers:
        return {}
    with ThreadPoolExecutor(len(peers), thread_name_prefix="swarm-metadata") as pool:
        asked = [pool.submit(transport.fetch, p, name, timeout, metadata_only) for p in peers]
        served = [a.result() for a in asked]
    return {p: s.meta for p, s in zip(peers, served, strict=True) if s is not None}


def gather_prints(transport: GroupTransport, name: str, peers: Sequence[str], timeout: float) -> PrintViews:
    """The prints (and their steps) in the served metadata of group ``name`` of each peer, asked at once."""
    metas = gather_metadata(transport, name, peers, timeout)
    return PrintViews(
        {p: read_prints(m) for p, m in metas.items()}, {p: read_print_steps(m) for p, m in metas.items()}
    )


@dataclass(frozen=True)
class PrintViews:
    """What the peers said they hold: ``prints`` {peer: {item: print}}, ``steps`` {peer: {item: step}};
    ``lr``, the peers' peak learning rate, bounds how far a newer copy may have grown (``norm_factor``)."""

    prints: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: dict[str, dict[str, int]] = field(default_factory=dict)
    lr: float | None = None

    def __or__(self, other: PrintViews) -> PrintViews:
        return PrintViews(self.prints | other.prints, self.steps | other.steps, self.lr)

    def without(self, peers: set[str]) -> PrintViews:
        return PrintViews(
            {p: v for p, v in self.prints.items() if p not in peers},
            {p: v for p, v in self.steps.items() if p not in peers},
            self.lr,
        )

    def reference(self, item: str, exclude: str) -> tuple[torch.Tensor | None, int | None]:
        """(the median of the prints of ``item`` that peers other than ``exclude`` serve, the median step of
        those prints or None if one of them came without a step); (None, None) if no peer serves one."""
        peers = [p for p, v in self.prints.items() if p != exclude and item in v]
        if not peers:
            return None, None
        steps = [self.steps.get(p, {}).get(item) for p in peers]
        step = None if None in steps else int(statistics.median(steps))
        return median_print([self.prints[p][item] for p in peers]), step

    def doubt(self, item: str, peer: str, tensors: Sequence[torch.Tensor], step: int | None = None) -> str:
        """Why ``peer``'s copy of ``item`` (from ``step``) cannot be what the others hold, or "" (also when
        nobody else serves a print of it)."""
        ref, ref_step = self.reference(item, exclude=peer)
        if ref is None:
            return ""
        apart = None if step is None or ref_step is None else step - ref_step
        return copy_doubt([copy_print(tensors)], [ref], factor=norm_factor(apart, self.lr, rms([ref])))
