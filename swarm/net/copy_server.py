"""What a peer serves of the experts it does not train: its copies of them, each with the step it is from,
so that an expert outlives its holders.

    copies = CopyServer(transport.open_server(f"{run}_copies"), model)
    copies.update({5: 120, 6: 118, 7: 0})   # expert -> the step our copy is from (0: the initialisation)
    with copies.lock:                        # held while the training thread overwrites copies
        overwrite(expert_tensors(model, 5), downloaded)

A joiner, or a peer that claims an expert whose holders are gone, asks every peer for the metadata of
its copies (``served_steps``: item -> (step, final)) and takes the newest valid one (``catch_up``). The copies
are read from the model when a downloader asks, fp16 on the wire, and not kept: serving them costs no
memory between downloads (which are rare: joins and re-claims). Copies at step 0 are the shared
initialisation, which every peer has anyway: they are not offered.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from swarm.model import MoETransformer
from swarm.net.expert_tensors import expert_tensors
from swarm.net.group_layout import expert_item
from swarm.net.transport import Group


class CopyServer:
    """See the module docstring."""

    def __init__(self, group: Group, model: MoETransformer) -> None:
        self.group, self.model = group, model
        self.lock = threading.Lock()
        self.steps: dict[int, int] = {}

    def update(self, steps: Mapping[int, int]) -> None:
        """Serve our copies of these experts (those we do not train) as of these steps."""
        with self.lock:
            self.steps = {e: int(s) for e, s in steps.items() if e not in self.model.local_experts and s > 0}
            experts = sorted(self.steps)
        meta = {
            "items": [expert_item(e) for e in experts],
            "steps": [self.steps[e] for e in experts],
            "final": [False] * len(experts),
        }
        self.group.serve(lambda: self._read(experts), meta)

    def _read(self, experts: list[int]) -> list[torch.Tensor]:
        with self.lock:  # never half of a copy the training thread is overwriting
            return [
                t.detach().to("cpu", torch.float16, copy=True)
                for e in experts
                for t in expert_tensors(self.model, e)
            ]
