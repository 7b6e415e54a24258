"""Peers of a round in one process, on the fault-injecting ``LocalNetwork``: what ``test_round`` and
``test_round_checks`` run their rounds on."""

import threading
import time

import torch

from swarm.config import SyncConfig
from swarm.net.expert_download import ExpertDownloads
from swarm.net.expert_server import ExpertServer
from swarm.net.group_layout import CORE, DENSE, OpenGroups, expert_item, layout
from swarm.net.local_transport import LocalNetwork
from swarm.net.membership import MembershipView
from swarm.net.records import Heartbeat
from swarm.net.round import RoundContext, RoundPlan, run_round
from swarm.net.timing import Timing
from swarm.sync.codecs import codec_named
from swarm.sync.robust_mean import aggregation_rule

N_EXPERTS = 4
TIMING = Timing(
    matchmaking_s=0.3, round_s=3.0, download_s=1.0, heartbeat_s=0.2, request_s=0.2, final_agreement_s=1.0
)


def expert_copy(seed: int) -> list[torch.Tensor]:  # two layers: (gate_up, down) each
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 4, generator=g), torch.randn(4, 4, generator=g)] * 2


def near_copy(base: list[torch.Tensor], seed: int, scale: float = 0.5) -> list[torch.Tensor]:
    """A peer's copy of shared weights: every peer's copies of an expert come from the same training, so
    that a holder's copy is a plausible later version of ours (``copy_doubt``), yet each peer's differs."""
    g = torch.Generator().manual_seed(seed)
    return [t + scale * torch.randn(t.shape, generator=g) for t in base]


class Swarm:
    """Peers on one ``LocalNetwork``, each with its own dense weights and copies of every expert."""

    def __init__(
        self,
        experts: dict[str, list[int]],
        faults=(),
        sync: SyncConfig | None = None,
        timing: Timing = TIMING,
    ):
        self.experts, self.sync = experts, sync or SyncConfig(max_rel_distance=4.0, codec="fp32")
        codec = codec_named(self.sync.codec)
        rule = aggregation_rule(self.sync.aggregation, self.sync.clip_factor)
        dense_codec = codec_named(self.sync.dense_codec_name)
        self.net = LocalNetwork(timing.matchmaking_s, faults, codec, rule, dense_codec)
        self.ctx, self.dense, self.copies = {}, {}, {}
        for i, me in enumerate(experts):
            transport = self.net.transport(me)
            deltas = None if codec.lossless else transport.open_server("t_expert_deltas", codec)
            server = ExpertServer(transport.open_server("t_experts"), deltas, codec)
            downloads = ExpertDownloads(
                transport, "t_experts", timing.download_s, 4.0, deltas and (deltas.name, codec)
            )
            self.ctx[me] = RoundContext(
                "t", me, self.net.store(me), timing, self.sync, N_EXPERTS, OpenGroups(transport), server, downloads
            )  # fmt: skip
            self.dense[me] = [torch.randn(6, 5, generator=torch.Generator().manual_seed(100 + i))]
            self.copies[me] = {e: near_copy(expert_copy(e), 1000 * i + e) for e in range(N_EXPERTS)}
        self.holders = {e: frozenset(p for p, ex in experts.items() if e in ex) for e in range(N_EXPERTS)}
        self.at_step(10)

    def at_step(self, step: int, states: dict[str, str] | None = None) -> None:
        """Every peer's heartbeat says ``step`` (a holder's copies are fresh from a round at that step), and
        its state (``training`` unless ``states`` says otherwise)."""
        states = states or {}
        beats = {
            p: Heartbeat(experts=ex, step=step, state=states.get(p, "training"))
            for p, ex in self.experts.items()
        }
        self.view = MembershipView(beats, self.holders, {})

    def plan(self, me: str, index: int = 1, weights: dict[str, float] | None = None, last: bool = False,
             refresh: bool = True, step: int = 10, copy_steps: dict[int, int] | None = None,
             full: bool = True):  # fmt: skip
        """``full``: a round of all the dense weights, else of the core ones (``ctx.core`` of ``dense[me]``)."""
        local, dense = self.experts[me], self.dense[me]
        w = {DENSE: 1.0, CORE: 1.0} | {expert_item(e): 1.0 for e in local} | (weights or {})
        specs, sole = layout("t", me, local, self.view.holders, full)
        like = {DENSE: dense, CORE: [dense[i] for i in self.ctx[me].core]}
        like |= {expert_item(e): self.copies[me][e] for e in local}
        groups = [(s, self.ctx[me].groups.get(s, like)) for s in specs]
        frozen = {e: self.copies[me][e] for e in range(N_EXPERTS) if e not in local}
        return RoundPlan(index, step, dense, {e: self.copies[me][e] for e in local}, frozen, w, groups, sole,
                         None, last, refresh=refresh, copy_steps=copy_steps or {})  # fmt: skip

    def round(self, plans: dict[str, RoundPlan], apart_s: float = 0.0, views: dict | None = None):
        """Each peer's round on a thread of its own, begun ``apart_s`` after the one before; with the
        swarm's ``view``, or a view of its own in ``views``."""
        results, threads, views = {}, [], views or {}

        def run(me: str, plan: RoundPlan) -> None:
            results[me] = run_round(plan, self.ctx[me], views.get(me, self.view))

        for me, plan in plans.items():
            threads.append(threading.Thread(target=run, args=(me, plan)))
        for i, t in enumerate(threads):
            if i and apart_s:
                time.sleep(apart_s)
            t.start()
        for t in threads:
            t.join(timeout=30)
        return results


def weighted_mean(parts: list[tuple[float, list[torch.Tensor]]]) -> list[torch.Tensor]:
    total = sum(w for w, _ in parts)
    return [sum(w * ts[i] for w, ts in parts) / total for i in range(len(parts[0][1]))]
