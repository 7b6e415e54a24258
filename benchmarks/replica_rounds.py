"""What a swarm's round does to its peers' weights, done to in-process replicas at once (the every_step
rows of ``convergence.py``): plain averaging, averages that land late (``LateAverages``) and the merge
warm-up. ``coded_average`` and ``outer_average`` average the same replicas through a codec or the outer
optimizer instead.

    average_replicas(models, owned, n_experts)    # every replica takes replica_means of all of them
    average_replicas(models, owned, n_experts, experts=False)   # of the dense weights only
    average_replicas(models, owned, n_experts, embeddings=False, experts=False)  # the dense but EMBEDDINGS
    merge_replicas(models, alpha, topk)           # the merge warm-up's step on every replica's experts
    average_moments(optimizers)                   # AdamW's two moments too, replicas that train alike

``owned[i]``: the experts replica ``i`` trains.
"""

from __future__ import annotations

import torch

from swarm.sync import merge_experts

# A prime above every seed the in-process rows use (peers' 1000 + i, central's train.seed + 1), so that
# no two draws, nor central and a peer, share a stream (a batch of 64 from a seed is four batches of 16).
DRAW_STRIDE = 1_000_003


def draw_seed(seed: int, draw: int) -> int:
    """A sampler's seed in the ``draw``-th draw of the data (0: the seeds every earlier result used)."""
    if draw < 0:
        raise ValueError(f"draw must be at least 0, got {draw}")
    return seed + DRAW_STRIDE * draw


def peer_samplers(ds, cfg, peers: int, draw: int = 0) -> list:
    """Each in-process peer's windows (``micro_batch`` of them a step), seeded by its index and ``draw``
    alone (not ``train.seed``): the every_step rows and data-parallel training (``update_averaging``) draw
    the very same ones, whatever their initial weights."""
    from swarm.data import WindowSampler

    return [WindowSampler(ds, cfg.data.seq_len, cfg.data.micro_batch, seed=draw_seed(1000 + i, draw))
            for i in range(peers)]  # fmt: skip


@torch.no_grad()
def merge_replicas(models: list, alpha: float, topk: int, owned: list[list[int]] | None = None) -> None:
    """The merge warm-up's step on every expert of every replica, each judged on the replica's own copies
    (after an average, every replica's): as if each holder merged its experts and the others' copies were
    refreshed at once, where a swarm refreshes them in its next round. With ``owned``, replica ``i`` merges
    only its own experts ``owned[i]`` and its copies wait for the next average of the experts, as a swarm's
    do (``--average-experts-every``, where that average may be many steps away)."""
    for i, m in enumerate(models):
        state = m.canonical_state_dict()
        for name in [n for n in state if n.endswith(".experts.gate_up")]:
            down = name.replace("gate_up", "down")
            local = owned[i] if owned is not None else list(range(state[name].shape[0]))
            device = state[name].device
            gate_up, down_proj = merge_experts(state[name].cpu(), state[down].cpu(), local, alpha, topk)
            state[name][local], state[down][local] = gate_up.to(device), down_proj.to(device)
        m.load_canonical_state_dict(state)


def replica_means(states: list[dict], owned: list[list[int]], n_exp: int) -> dict[str, torch.Tensor]:
    """Dense weights: the mean of every replica's state; expert e: the mean of the replicas that train it
    (an expert that none trains, when peers x per_peer < n_experts, replica 0's)."""
    merged = {}
    for name in states[0]:
        if ".experts." not in name:
            merged[name] = torch.stack([s[name] for s in states]).mean(0)
            continue
        merged[name] = torch.empty_like(states[0][name])
        for e in range(n_exp):
            holders = [s[name][e] for s, own in zip(states, owned, strict=True) if e in own]
            merged[name][e] = torch.stack(holders).mean(0) if holders else states[0][name][e]  # untrained
    return merged


# The token embeddings and the output head: 80% of the demo shape's dense weights, the rest being attention,
# norms and routers
EMBEDDINGS = frozenset({"embed.weight", "lm_head.weight"})


def averaged_part(name: str, dense: bool, experts: bool, embeddings: bool | None = None) -> bool:
    """Whether a round of the dense weights (``dense``), of the experts (``experts``) or of both covers the
    tensor ``name``; ``embeddings`` (default: as ``dense``) decides for ``EMBEDDINGS`` on their own."""
    if ".experts." in name:
        return experts
    return dense if embeddings is None or name not in EMBEDDINGS else embeddings


@torch.no_grad()
def average_replicas(models: list, owned: list[list[int]], n_exp: int, dense: bool = True,
                     experts: bool = True, embeddings: bool | None = None) -> None:  # fmt: skip
    """Every replica takes ``replica_means`` of their states (an expert that none trains stays as it is):
    of the dense weights, of the experts (an expert with one trainer: the others' copies of it), or both;
    ``embeddings`` (default: as ``dense``) for ``EMBEDDINGS`` apart from the other dense weights."""
    merged = replica_means([m.canonical_state_dict() for m in models], owned, n_exp)
    for m in models:
        state = m.canonical_state_dict()
        state.update({k: v for k, v in merged.items() if averaged_part(k, dense, experts, embeddings)})
        m.load_canonical_state_dict(state)


@torch.no_grad()
def average_moments(optimizers: list[torch.optim.Optimizer]) -> None:
    """Every replica's AdamW moments (``exp_avg``, ``exp_avg_sq``) become their mean over the replicas, as
    if their optimizer state had been averaged with the weights. The replicas must train the same
    parameters (every expert, as the every_step row's do): their parameters are paired by position."""
    params = [[p for g in opt.param_groups for p in g["params"]] for opt in optimizers]
    if len({tuple(p.shape for p in ps) for ps in params}) != 1:
        raise ValueError("average_moments: the replicas' parameters differ in number or shape")
    for same in zip(*params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            slots = [opt.state[p][key] for opt, p in zip(optimizers, same, strict=True)]
            mean = torch.stack(slots).mean(0)
            for slot in slots:
                slot.copy_(mean)


class LateAverages:
    """Averages that land ``delay`` steps after the weights they average were taken, as a peer's round
    runs in the background while it trains on: each replica then takes theta + (a - s), the average a of
    the snapshots s plus its own steps since (``swarm.sync.apply_average``'s plain rule).

        late = LateAverages(owned, n_experts, delay=4)
        late.start(models, step, dense=True, experts=False)   # a round begins: snapshots, their means
        late.land(models, step)                               # rounds begun ``delay`` steps ago land
        late.land(models, step, everything=True)              # all that are in flight (before the last)
    """

    def __init__(self, owned: list[list[int]], n_exp: int, delay: int) -> None:
        if delay < 0:
            raise ValueError("delay must be >= 0 steps")
        self.owned, self.n_exp, self.delay = owned, n_exp, delay
        self._in_flight: list[tuple[int, list[str], list[dict], dict]] = []  # (lands at, names, snaps, means)

    @torch.no_grad()
    def start(self, models: list, step: int, dense: bool = True, experts: bool = True) -> None:
        snaps = [m.canonical_state_dict() for m in models]  # detached copies already
        means = replica_means(snaps, self.owned, self.n_exp)
        names = [k for k in means if averaged_part(k, dense, experts)]
        self._in_flight.append((step + self.delay, names, snaps, means))

    @torch.no_grad()
    def land(self, models: list, step: int, everything: bool = False) -> None:
        due = [r for r in self._in_flight if everything or r[0] <= step]
        self._in_flight = [r for r in self._in_flight if not (everything or r[0] <= step)]
        for _, names, snaps, means in due:
            for m, snap in zip(models, snaps, strict=True):
                state = m.canonical_state_dict()
                state.update({k: state[k] + (means[k] - snap[k]) for k in names})
                m.load_canonical_state_dict(state)
