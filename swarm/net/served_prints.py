"""Prints of every copy a peer holds, served with its dense weights, so that a joiner can check what one
peer gives it against what the others hold.

    meta["prints"] = served_prints(dense, {e: expert_tensors(model, e) for e in range(E)})   # ~1 KB each
    views = gather_prints(transport, "demo_dense", peers, timeout=5.0)   # {peer: {item: print}}, metadata only
    ref = reference_print(views, "expert3", exclude="<the holder offering it>")
    why = copy_doubt([copy_print(offered)], [ref]) if ref is not None else ""

A holder serves its own experts; every other peer holds a copy of them as of its last refresh, and every
peer the dense weights as of its last round. The coordinate-wise median of the other peers' prints is what
the swarm holds; an offered copy far from it (``copy_doubt``) was negated, zeroed or scaled by whoever
served it. What peers serve may be anything: malformed prints are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from swarm.net.group_layout import DENSE, MAX_NAME, expert_item
from swarm.net.transport import GroupTransport
from swarm.sync.copy_prints import copy_print, median_print, print_bytes, print_from_bytes

MAX_PRINTS = 4096  # items in one peer's prints: far above any model's experts + 1


def served_prints(
    dense: Sequence[torch.Tensor], experts: Mapping[int, Sequence[torch.Tensor]]
) -> dict[str, bytes]:
    """{item: print bytes} of the dense weights and every expert copy given (local or not)."""
    out = {DENSE: print_bytes(copy_print(dense))}
    return out | {expert_item(e): print_bytes(copy_print(ts)) for e, ts in sorted(experts.items())}


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


def gather_prints(
    transport: GroupTransport, name: str, peers: Sequence[str], timeout: float
) -> dict[str, dict[str, torch.Tensor]]:
    """{peer: its prints} from the served metadata of group ``name`` of each peer, asked at once."""
    return {p: read_prints(meta) for p, meta in gather_metadata(transport, name, peers, timeout).items()}


def reference_print(
    views: Mapping[str, Mapping[str, torch.Tensor]], item: str, exclude: str
) -> torch.Tensor | None:
    """The median of the prints of ``item`` that peers other than ``exclude`` serve, or None if none does."""
    prints = [v[item] for p, v in views.items() if p != exclude and item in v]
    return median_print(prints) if prints else None
