"""Synchronous averaging of in-process replicas through the swarm's outer optimizer, as ``sync.sync_alpha``
and ``sync.outer_momentum`` apply a round's average.

    average = OuterAverage(owned, n_experts, alpha=1.0, momentum=0.5)
    average(models)          # in place of ``replica_rounds.average_replicas(models, owned, n_experts)``

Each replica keeps its own ``swarm.sync.apply_average.OuterStep``, as each peer does, and steps every tensor
it trains: the dense weights towards the mean of every replica, an expert towards the mean of the replicas
that train it (an expert with one trainer takes the outer step on its own progress, as in the swarm). A
replica's copy of an expert it does not train is then the first trainer's result, as a refreshed copy is
(replica 0's when nobody trains it, as ``average_replicas`` leaves it).
Averaged synchronously there are no steps taken meanwhile, so the snapshot is the replica's state itself.
With ``alpha=1, momentum=0`` this is plain averaging, ``average_replicas``'s result.
"""

from __future__ import annotations

import torch

from benchmarks.replica_rounds import replica_means
from swarm.sync.apply_average import OuterStep


class OuterAverage:
    """See the module docstring. ``owned[i]``: the experts replica ``i`` trains."""

    def __init__(self, owned: list[list[int]], n_experts: int, alpha: float, momentum: float) -> None:
        self.owned, self.n_experts = owned, n_experts
        self.steps = [OuterStep(alpha, momentum) for _ in owned]

    @torch.no_grad()
    def __call__(self, models: list, dense: bool = True, experts: bool = True) -> None:
        if not (dense and experts):  # the outer step's momentum is kept for the whole model's progress
            raise ValueError("an outer step averages the dense weights and the experts together")
        states = [m.canonical_state_dict() for m in models]
        means = replica_means(states, self.owned, self.n_experts)
        for state, own, step in zip(states, self.owned, self.steps, strict=True):
            params, average = {}, {}  # views into ``state``, which the outer step moves in place
            for name, value in state.items():
                if ".experts." not in name:
                    params[name], average[name] = value, means[name]
                    continue
                for e in own:
                    params[f"{name}/{e}"], average[f"{name}/{e}"] = value[e], means[name][e]
            step.apply(params, {k: v.clone() for k, v in params.items()}, average)
        for name in [n for n in states[0] if ".experts." in n]:
            for e in range(self.n_experts):
                trainers = [i for i, own in enumerate(self.owned) if e in own]
                # nobody trains it: replica 0's, as the means hold it
                source = states[trainers[0]][name][e] if trainers else means[name][e]
                for state, own in zip(states, self.owned, strict=True):
                    if e not in own:
                        state[name][e] = source
        for m, state in zip(models, states, strict=True):
            m.load_canonical_state_dict(state)
