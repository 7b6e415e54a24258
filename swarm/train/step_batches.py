"""The windows of one optimizer step, as the batches that the trainer backpropagates one after another."""

from __future__ import annotations

import torch

from swarm.data import WindowSampler


def step_batches(sampler: WindowSampler, accum: int, halves: bool = False) -> list[torch.Tensor]:
    """``accum`` micro-batches from ``sampler``. With ``halves`` the first half of the list holds half the
    step's windows (``PooledMomentAdamW.mark_half`` is called between the two): an odd ``accum``'s
    micro-batches are each cut in two, which ``train.pooled_moment``'s config check keeps possible."""
    batches = [sampler.next_batch() for _ in range(accum)]
    if halves and accum % 2:
        batches = [part for batch in batches for part in batch.chunk(2)]
    return batches
