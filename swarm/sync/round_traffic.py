"""What one round moves per peer, predicted from the run config, and how long a link needs for it.

    traffic = round_traffic(cfg)             # 4 peers x 4 of 16 experts by default (E / per_peer peers)
    traffic.per_peer                         # bytes a peer sends and receives in one (refresh) round
    traffic.mean_per_peer(4)                 # per round, over many, with copies every 4th (refresh_every)
    traffic.mean_per_peer(4, 8)              # and all the dense weights every 8th, the core ones between
    traffic.link_seconds(100)                # the least time that takes over 100 Mbit/s each way
    slow_link_advice(cfg)                    # what to raise where a round cannot fit such a link, or None

The design's count (``swarm-demo``'s summary sets it beside what its peers measured): the dense all-reduce
(butterfly: 2(n-1)/n of the dense weights sent and as much received), each own expert's all-reduce among
its r holders (4(r-1)/r of its bytes), and the non-local experts' copies, received by a peer and served by
their holders (fp16 copies with a lossless codec, encoded changes with a lossy one), which move only in
refresh rounds (every ``sync.refresh_every``-th). With ``sync.embeddings_every`` the dense all-reduce moves
all the dense weights every that many rounds and the core ones (all but the token embeddings and output
head) in the others. Each tensor at its codec's size on the wire
(``Codec.wire_bytes``). hivemind's framing and matchmaking add about 5% (a demo measured 7.61 MB a round
against the 7.27 predicted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm.config import RunConfig
from swarm.model import MoETransformer
from swarm.model.transformer import VOCAB_ROWS
from swarm.sync.codecs import Codec, codec_named

REFERENCE_MBIT = 100.0  # the link speed the presets are sized for: an ordinary fibre or cable line
# measured rounds took 1.25 to 1.45 times their payload's link time (wan.py on GPU peers, 100 Mbit/s)
ROUND_OVER_LINK = 1.5


@dataclass(frozen=True)
class ModelBytes:
    """Wire bytes of the dense weights (``dense_codec``), of one expert over all layers (``codec``), of one
    expert's copy (fp16 with a lossless codec, else ``codec``), and of the core dense weights."""

    dense: int
    expert: int
    copy: int
    core: int = 0

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]], codec: Codec, dense_codec: Codec) -> ModelBytes:
        """From the canonical tensors' shapes (an expert tensor is [n_experts, ...])."""
        dense = expert = copy = core = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if ".experts." in name:
                one = numel // shape[0]
                expert += codec.wire_bytes(one)
                copy += 2 * one if codec.lossless else codec.wire_bytes(one)
            else:
                dense += dense_codec.wire_bytes(numel)
                core += 0 if name in VOCAB_ROWS else dense_codec.wire_bytes(numel)
        return cls(dense, expert, copy, core)


@dataclass(frozen=True)
class RoundTraffic:
    """A peer's bytes in one round (sent + received, the mean over the swarm's peers), by what they carry."""

    peers: int
    dense: int  # the dense all-reduce
    experts: int  # own experts' all-reduces with their other holders (none with one holder each)
    copies: int  # non-local experts' copies received, and own experts' copies served
    core: int = 0  # the dense all-reduce of a round that averages the core dense weights only

    @property
    def per_peer(self) -> int:
        """A refresh round's bytes: the most any round moves (what a link and a round's timeout must fit)."""
        return self.dense + self.experts + self.copies

    def mean_per_peer(self, refresh_every: int = 1, embeddings_every: int = 1) -> float:
        """Bytes per round over many rounds when the copies move only in every ``refresh_every``-th
        (``sync.refresh_every``) and all the dense weights in every ``embeddings_every``-th, the core ones
        in the others (``sync.embeddings_every``): what a peer's link carries on average, round after round."""
        dense = (self.dense + (embeddings_every - 1) * self.core) / embeddings_every
        return dense + self.experts + self.copies / refresh_every

    def link_seconds(self, mbit: float) -> float:
        """The least time the round takes on a link of ``mbit`` Mbit/s each way (half of it is sent)."""
        return self.per_peer / 2 / (mbit * 1e6 / 8)

    @classmethod
    def of(cls, sizes: ModelBytes, experts: Sequence[Sequence[int]], n_experts: int) -> RoundTraffic:
        """For peers training ``experts`` (one list per peer). Each copy a peer receives, a holder serves."""
        n = len(experts)
        holders = [sum(e in ex for ex in experts) for e in range(n_experts)]
        own = sum(4 * (h - 1) * sizes.expert for h in holders if h > 0)  # h members x 4(h-1)/h each
        copies = 2 * sum(n_experts - len(ex) for ex in experts) * sizes.copy
        dense, core = (int(4 * (n - 1) / n * b) for b in (sizes.dense, sizes.core))
        return cls(n, dense, int(own / n), int(copies / n), core)


def round_traffic(cfg: RunConfig, peers: int | None = None) -> RoundTraffic:
    """The design's bytes per peer per round for ``cfg`` with ``peers`` peers (default: as many as make one
    holder per expert, ``n_experts / experts.per_peer``, at least 2), each training ``experts.per_peer``
    of them, assigned round robin as claims do (coverage first)."""
    m, sc = cfg.model, cfg.sync
    k = len(cfg.experts.local) if cfg.experts.local else (cfg.experts.per_peer or m.n_experts)
    n = peers or max(2, m.n_experts // k)
    with torch.device("meta"):  # shapes only: no memory, whatever the model's size
        state = MoETransformer(m, list(range(k))).canonical_state_dict()
    sizes = ModelBytes.of({name: t.shape for name, t in state.items()}, codec_named(sc.codec),
                          codec_named(sc.dense_codec_name))  # fmt: skip
    experts = [[(i * k + j) % m.n_experts for j in range(k)] for i in range(n)]
    return RoundTraffic.of(sizes, experts, m.n_experts)


def slow_link_advice(cfg: RunConfig, mbit: float = REFERENCE_MBIT) -> str | None:
    """Why rounds of ``cfg`` would overrun on a link of ``mbit`` Mbit/s, and what to set; None if they fit:
    ``sync.round_timeout_s`` must cover a round, and with rounds on the wall clock ``sync.sync_every_s``
    too (a round still running when its slot ends skips the next)."""
    traffic = round_traffic(cfg)
    need = ROUND_OVER_LINK * traffic.link_seconds(mbit)
    sc = cfg.sync
    short = [f"sync.round_timeout_s={sc.round_timeout_s:g}"] if sc.round_timeout_s < need else []
    if 0 < sc.sync_every_s < need:
        short.append(f"sync.sync_every_s={sc.sync_every_s:g}")
    if not short:
        return None
    size = (
        f"{traffic.per_peer / 1e9:.2f} GB" if traffic.per_peer >= 1e9 else f"{traffic.per_peer / 1e6:.1f} MB"
    )
    step = 10 if need >= 10 else 1
    return (
        f"a round moves about {size} per peer ({traffic.peers} peers), {need:.1f} s or more at {mbit:g} "
        f"Mbit/s: {' and '.join(short)} would cut rounds short on such links; raise "
        f"{'it' if len(short) == 1 else 'them'} to {math.ceil(need / step) * step} s or more"
    )
