"""How busy each host's link was during its rounds: where a round's time over its payload goes.

    with LinkSampler(lan.counters, hosts=[1, 2, 3, 4]) as sampler:   # ShapedLan hosts, read every 50 ms
        ...                                                        # the swarm runs
    use = link_use(sampler.samples(1), start, end, rate=100e6 / 8)  # one round of host 1 (wall clock)

A round that carries its payload at the link's rate from its first to its last second meets
``round_vs_link`` of about 1 (wan.py). ``link_use`` says how far a round was from that and where: the share
of the round's seconds the busier direction would need at the link's rate (``busy``), the seconds before
that direction first ran at half the link's rate or more (``head_s``: matchmaking, a holder's copy not yet
fresh) and after it last did (``tail_s``: decoding, checks and commits once the bytes are in).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Counters = Callable[[int], tuple[int, int]]  # host -> (bytes sent, bytes received) so far


@dataclass(frozen=True)
class LinkUse:
    """One round on one host's link (see the module docstring); seconds and shares of the round."""

    busy: float
    head_s: float
    tail_s: float


class LinkSampler:
    """Reads every host's byte counters every ``period_s`` on a thread of its own, with the wall-clock time
    (round records carry wall-clock starts), until the with block ends."""

    def __init__(self, counters: Counters, hosts: Sequence[int], period_s: float = 0.05) -> None:
        self.counters, self.hosts, self.period_s = counters, list(hosts), period_s
        self._rows: list[tuple[float, tuple[tuple[int, int], ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="link-sampler", daemon=True)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                row = tuple(self.counters(h) for h in self.hosts)
            except OSError:  # a link removed under us: the run is ending
                return
            self._rows.append((time.time(), row))
            self._stop.wait(self.period_s)

    def samples(self, host: int) -> list[tuple[float, int, int]]:
        """(wall time, bytes sent, bytes received) of ``host``, oldest first."""
        k = self.hosts.index(host)
        return [(t, row[k][0], row[k][1]) for t, row in list(self._rows)]


def link_use(
    samples: Sequence[tuple[float, int, int]], start: float, end: float, rate: float
) -> LinkUse | None:
    """The link's use by one host from ``start`` to ``end`` (wall clock), ``rate`` in bytes per second each
    way; None where fewer than two samples fall in the window. Each direction is read on its own; the
    busier one (more bytes) is the round's."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or end <= start:
        return None
    moved = [inside[-1][k] - inside[0][k] for k in (1, 2)]
    k = 1 + moved.index(max(moved))  # the busier direction
    fast = [
        (a[0], b[0])
        for a, b in zip(inside, inside[1:], strict=False)
        if b[0] > a[0] and (b[k] - a[k]) / (b[0] - a[0]) >= rate / 2
    ]
    head = fast[0][0] - start if fast else end - start
    tail = end - fast[-1][1] if fast else 0.0
    return LinkUse(busy=max(moved) / rate / (end - start), head_s=head, tail_s=tail)
