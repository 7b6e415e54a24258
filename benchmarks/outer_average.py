"""Synchronous averaging of in-process replicas through the swarm's outer optimizer, as ``sync.sync_alpha``
and ``sync.outer_momentum`` apply a round's average.

    average = OuterAverage(models, owned, n_experts, alpha=1.0, momentum=0.5)
    average(models)          # in place of ``convergence_runs.average_replicas(models, owned, n_experts)``

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

from swarm.sync.apply_average import OuterStep


class OuterAverage:
    """See the module docstring. ``owned[i]``: the experts replica ``i`` trains."""

    def __init__(self, models: list, owned: list[list[int]], n_experts: int, alpha: float, momentum: float):
        self.owned, self.n_experts = owned, n_experts
        self.steps = [OuterStep(alpha, momentum) for _ in models]

    def _means(self, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per name (an expert as ``name/e``), the mean of the replicas that train it."""
        means = {}
        for name in states[0]:
            if ".experts." not in name:
                means[name] = torch.stack([s[name] for s in states]).mean(0)
                continue
            for e in range(self.n_experts):
                holders = [s[name][e] for s, own in zip(states, self.owned, strict=True) if e in own]
                if holders:
                    means[f"{name}/{e}"] = torch.stack(holders).mean(0)
        return means

    @torch.no_grad()
    def __call__(self, models: list) -> None:
        states = [m.canonical_state_dict() for m in models]
        means = self._means(states)
        for state, own, step in zip(states, self.owned, self.steps, strict=True):
            params = {}  # views into ``state``, which the outer step moves in place
            for name, value in state.items():
                if ".experts." not in name:
                    params[name] = value
                else:
                    params.update({f"{name}/{e}": value[e] for e in own})
            snapshot = {k: v.clone() for k, v in params.items()}
            step.apply(params, snapshot, {k: means[k] for k in params})
        for name in states[0]:
            if ".experts." not in name:
                continue
            for e in range(self.n_experts):
                trainers = [i for i, own in enumerate(self.owned) if e in own]
                source = states[trainers[0] if trainers else 0][name][e]  # nobody trains it: replica 0's
                for state, own in zip(states, self.owned, strict=True):
                    if e not in own:
                        state[name][e] = source
        for m, state in zip(models, states, strict=True):
            m.load_canonical_state_dict(state)
