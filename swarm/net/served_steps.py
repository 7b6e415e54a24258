"""What a holder's served metadata says of its copies, read by downloaders before any tensor travels.

    served_steps(meta)                        # {"expert3": (100, False)}: item -> (step, final)
    transport.fetch(peer, name, timeout, accept=Fresh(("expert3",), 100, final=False))

``Fresh`` is the ``accept`` of ``GroupTransport.fetch``: a copy that is not worth having (not fresh yet,
not final, a change against none of our copies) costs the metadata's few bytes, not the copy's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fresh:
    """Whether a holder's served metadata offers the copies worth downloading (``GroupTransport.fetch``'s
    ``accept``): every item, each final (``final``) or from ``min_step`` on (None: any step)."""

    items: tuple[str, ...]
    min_step: int | None
    final: bool
    bases: tuple[tuple[str, str], ...] = ()  # (item, hash of our copy): changes, taken against one of them

    def __call__(self, meta: Mapping) -> bool:
        steps = served_steps(meta)
        if not all(i in steps for i in self.items) or not fits_any(meta, self.bases):
            return False
        if self.final:
            return all(steps[i][1] for i in self.items)
        return self.min_step is None or min(steps[i][0] for i in self.items) >= self.min_step


def fits_any(meta: Mapping, bases: Sequence[tuple[str, str]]) -> bool:
    """Whether served changes (``ExpertServer``'s metadata: each item's ``base`` hash) include one taken
    against one of ``bases`` ((item, hash) pairs); True when no bases are given."""
    if not bases:
        return True
    items, hashes = meta.get("items"), meta.get("base")
    if not isinstance(items, list) or not isinstance(hashes, list) or len(items) != len(hashes):
        return False
    served = {i: h for i, h in zip(items, hashes, strict=True) if isinstance(i, str)}
    return any(served.get(i) == h for i, h in bases)


def served_steps(meta: Mapping) -> dict[str, tuple[int, bool]]:
    """{item: (step, final)} of what a holder serves; {} if its metadata is malformed."""
    items, steps, final = meta.get("items"), meta.get("steps"), meta.get("final")
    ok = isinstance(items, list) and isinstance(steps, list) and isinstance(final, list)
    if not ok or not len(items) == len(steps) == len(final):
        return {}
    return {
        i: (s, bool(f))
        for i, s, f in zip(items, steps, final, strict=True)
        if isinstance(i, str) and isinstance(s, int) and not isinstance(s, bool)
    }
