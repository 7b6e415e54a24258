"""Synchronous averaging of in-process replicas through a lossy codec, as a swarm with ``sync.codec`` does it.

    average = CodedAverage(codec_named("int8"), models, owned, n_experts)
    average(models)          # in place of ``replica_rounds.average_replicas(models, owned, n_experts)``
    average(models, experts=False)   # the dense weights alone, as a round between refresh rounds

It isolates what the codec costs the model's learning from everything else a real swarm adds (waiting,
stale results, dropped rounds, noise between runs): the same replicas, batches and seeds, averaged at the
same steps, with only the codec changed. Each replica sends its change since the last agreed state plus what
the codec dropped from it last time (error feedback), encoded. The members' encoded changes are averaged, and
each member gets the mean back as an encoded change from what it sent, as ``swarm.net.local_transport``
models hivemind's butterfly (it leaves out that a member's own share of the tensor comes back exact). A
replica that does not train an expert refreshes its copy as an encoded change against the copy it holds,
from the first trainer's result. The state each member ends a round with is its reference for that tensor's
next round: a round of the dense weights alone leaves the experts' references, and what their codec dropped,
as they were.
"""

from __future__ import annotations

import torch

from benchmarks.replica_rounds import averaged_part
from swarm.sync.codecs import Codec


class CodedAverage:
    """See the module docstring. ``owned[i]``: the experts replica ``i`` trains."""

    def __init__(
        self, codec: Codec, models: list, owned: list[list[int]], n_experts: int, dense: Codec | None = None
    ) -> None:
        self.codec, self.owned, self.n_experts = codec, owned, n_experts
        self.dense = dense or codec  # the dense weights' codec (``sync.dense_codec``)
        self.refs = [m.canonical_state_dict() for m in models]  # every replica starts from the same state
        self.dropped = [{k: torch.zeros_like(v) for k, v in ref.items()} for ref in self.refs]

    def _members_mean(
        self, members: list[int], now: list, name: str, part, codec: Codec
    ) -> dict[int, torch.Tensor]:
        """Each member's result for ``name[part]``: its reference plus the mean of the members' encoded
        changes, as it came back to it encoded."""
        sent = {}
        for i in members:
            change = now[i][name][part] - self.refs[i][name][part] + self.dropped[i][name][part]
            sent[i] = codec.roundtrip(change)
            self.dropped[i][name][part] = change - sent[i]
        mean = torch.stack(list(sent.values())).mean(0)
        return {i: self.refs[i][name][part] + sent[i] + codec.roundtrip(mean - sent[i]) for i in members}

    @torch.no_grad()
    def __call__(self, models: list, dense: bool = True, experts: bool = True) -> None:
        now = [m.canonical_state_dict() for m in models]
        everyone = list(range(len(models)))
        for name in now[0]:
            if not averaged_part(name, dense, experts):
                continue
            if ".experts." not in name:
                for i, result in self._members_mean(everyone, now, name, slice(None), self.dense).items():
                    now[i][name] = result
                continue
            for e in range(self.n_experts):
                holders = [i for i in everyone if e in self.owned[i]]
                if not holders:  # nobody trains it: it stays as it is
                    continue
                results = self._members_mean(holders, now, name, e, self.codec)
                for i in everyone:
                    if i in results:
                        now[i][name][e] = results[i]
                    else:  # a frozen copy, refreshed by the change from the copy it holds
                        held = now[i][name][e]
                        now[i][name][e] = held + self.codec.roundtrip(results[holders[0]] - held)
        for m, state in zip(models, now, strict=True):
            m.load_canonical_state_dict(state)
        # fresh copies of their own: loading copies them into the models
        for ref, state in zip(self.refs, now, strict=True):
            ref.update({k: v for k, v in state.items() if averaged_part(k, dense, experts)})
