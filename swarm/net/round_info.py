"""What each member of a group tells the others (``RoundInfo``), gathered by the group and checked by all.

info = RoundInfo(step=300, round=3, last=False, weights=(1.0,), reference="", rule="centered_trim",
                 digests="direct")
group.start(tensors, info.to_msg(), ...)
theirs = RoundInfo.from_msg(gathered[peer], n_items=1)     # None unless well formed and plausible
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarm.sync.robust_mean import AGGREGATIONS

# weights are tokens in units of one sync interval's batches: a peer cannot plausibly report more than this
MAX_WEIGHT = 100.0
WEIGHT_TOLERANCE = 1e-4
MAX_REFERENCE = 128
DIGEST_EXCHANGES = ("direct", "dht")
REFERENCES_DIFFER = "members' deltas were against different references"


@dataclass(frozen=True)
class RoundInfo:
    """What each member of a group tells the others, gathered by the group."""

    step: int
    round: int
    last: bool
    weights: tuple[float, ...]  # per item of the group, in order
    reference: str = ""  # the agreed state our deltas are against ("": we send weights; round_payload)
    rule: str = "mean"  # how we reduce our part (``swarm.sync.robust_mean``): every member must use the same
    digests: str = "dht"  # how we exchange round digests (``sync.digests``): every member must use the same

    def to_msg(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "round": self.round,
            "last": self.last,
            "weights": list(self.weights),
            "ref": self.reference,
            "rule": self.rule,
            "digests": self.digests,
        }

    @classmethod
    def from_msg(cls, value: Any, n_items: int) -> RoundInfo | None:
        """Parse another member's info; None unless every field is well formed and plausible."""
        if not isinstance(value, dict):
            return None
        step, index, last, weights = (value.get(k) for k in ("step", "round", "last", "weights"))
        reference, rule = value.get("ref", ""), value.get("rule", "mean")
        digests = value.get("digests", "dht")  # peers before ``sync.digests`` used the DHT
        if rule not in AGGREGATIONS or digests not in DIGEST_EXCHANGES:  # also anything unhashable
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, index)):
            return None
        if not isinstance(reference, str) or len(reference) > MAX_REFERENCE:
            return None
        if not isinstance(last, bool) or not isinstance(weights, list) or len(weights) != n_items:
            return None
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= MAX_WEIGHT:
                return None  # also NaN and inf
        return cls(step, index, last, tuple(float(w) for w in weights), reference, rule, digests)


def common_reference(infos: Sequence[RoundInfo]) -> str:
    """The reference most members' changes were against (ties: the smallest id); "" if none had one."""
    counts = Counter(i.reference for i in infos if i.reference)
    return max(sorted(counts), key=lambda r: counts[r]) if counts else ""
