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

from swarm.sync.codecs import CODECS
from swarm.sync.robust_mean import AGGREGATIONS

# weights are tokens in units of one sync interval's batches: a peer cannot plausibly report more than this
MAX_WEIGHT = 100.0
WEIGHT_TOLERANCE = 1e-4
MAX_REFERENCE = 128
MAX_COUNT = 1 << 20  # a member's quorum or held rounds: anything larger is implausible
# a reference stays through at most this many applied rounds short of their quorum: a peer in view that
# never makes it into a group (out of phase, or gone but not yet silent for long) then costs one dropped
# round every few, instead of deltas against an ever older state
MAX_HELD = 3
DIGEST_EXCHANGES = ("direct", "dht")
REFERENCES_DIFFER = "members' deltas were against different references"
ROBUST_PAIR = "a pair while a member sees three or more peers: no majority to bound a rogue member"


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
    quorum: int = 0  # how many members our reference waits for before it moves on (``reference_moves``)
    held: int = 0  # rounds we applied since our reference last moved on
    # how our group's tensors travel (``sync.codec``, ``sync.dense_codec``): every member's must match
    codec: str = ""
    # how many members our view expects in the group (``expected_members``, ourselves included): a dense pair
    # is dropped under a robust rule if any member expects three or more (``unbounded_pair``), by all alike
    in_view: int = 0

    def to_msg(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "round": self.round,
            "last": self.last,
            "weights": list(self.weights),
            "ref": self.reference,
            "rule": self.rule,
            "digests": self.digests,
            "quorum": self.quorum,
            "held": self.held,
            "codec": self.codec,
            "in_view": self.in_view,
        }

    @classmethod
    def from_msg(cls, value: Any, n_items: int) -> RoundInfo | None:
        """Parse another member's info; None unless every field is well formed and plausible."""
        if not isinstance(value, dict):
            return None
        step, index, last, weights = (value.get(k) for k in ("step", "round", "last", "weights"))
        reference, rule = value.get("ref", ""), value.get("rule", "mean")
        digests = value.get("digests", "dht")  # peers before ``sync.digests`` used the DHT
        codec = value.get("codec", "")  # "": a peer from before codecs were named (it fits no group now)
        if rule not in AGGREGATIONS or digests not in DIGEST_EXCHANGES or codec not in ("", *CODECS):
            return None  # also anything unhashable
        # 0: a peer from before these fields
        quorum, held, in_view = value.get("quorum", 0), value.get("held", 0), value.get("in_view", 0)
        counts = (quorum, held, in_view)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, index, *counts)):
            return None
        if not all(0 <= v <= MAX_COUNT for v in counts):
            return None
        if not isinstance(reference, str) or len(reference) > MAX_REFERENCE:
            return None
        if not isinstance(last, bool) or not isinstance(weights, list) or len(weights) != n_items:
            return None
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= MAX_WEIGHT:
                return None  # also NaN and inf
        ws = tuple(float(w) for w in weights)
        return cls(step, index, last, ws, reference, rule, digests, quorum, held, codec, in_view)


def common_reference(infos: Sequence[RoundInfo]) -> str:
    """The reference most members' changes were against (ties: the smallest id); "" if none had one."""
    counts = Counter(i.reference for i in infos if i.reference)
    return max(sorted(counts), key=lambda r: counts[r]) if counts else ""


def reference_moves(infos: Sequence[RoundInfo], size: int) -> bool:
    """Whether a lossy codec's members take this round's result as their next reference (``round_payload``).
    Only a round with every member that each expected does, or one whose reference has been held for
    ``MAX_HELD`` rounds: a group that split (rounds on steps, peers out of phase), or one that a joiner has
    yet to join, would otherwise leave members with other references, and the next round with them all
    would be dropped. Every member decides from the same infos, so all decide alike."""
    return size >= max(i.quorum for i in infos) or max(i.held for i in infos) >= MAX_HELD
