"""Checks every averaged or downloaded tensor passes before it touches the model.

hivemind lets NaN and huge values through and trusts each sender's weight (see NOTES.md), so a peer
verifies shape, dtype, finiteness and distance from its own copy, and clamps the weights it reports.
"""

from __future__ import annotations

import torch


class RejectedTensor(ValueError):
    """A received tensor failed a check; the message names the tensor and the reason."""


def check_tensor(name: str, received: torch.Tensor, local: torch.Tensor, max_rel_distance: float) -> None:
    """Raise RejectedTensor unless ``received`` has ``local``'s shape, is finite, and
    ||received - local|| <= max_rel_distance * (||local|| + 1e-6)."""
    if tuple(received.shape) != tuple(local.shape):
        raise RejectedTensor(f"{name}: shape {tuple(received.shape)}, expected {tuple(local.shape)}")
    if not received.is_floating_point():
        raise RejectedTensor(f"{name}: dtype {received.dtype} is not floating point")
    if not torch.isfinite(received).all():
        raise RejectedTensor(f"{name}: contains NaN or inf")
    mine = local.detach().to(received.device, torch.float32)  # ours may live on a GPU, in bf16
    dist = torch.linalg.vector_norm(received.float() - mine).item()
    scale = torch.linalg.vector_norm(mine).item() + 1e-6
    if dist > max_rel_distance * scale:
        raise RejectedTensor(f"{name}: relative distance {dist / scale:.3g} exceeds {max_rel_distance}")


def check_tensors(
    name: str, received: list[torch.Tensor], local: list[torch.Tensor], max_rel_distance: float
) -> None:
    """``check_tensor`` on each of a group's tensors (``name[i]``), after checking that the counts match."""
    if len(received) != len(local):
        raise RejectedTensor(f"{name}: {len(received)} tensors, expected {len(local)}")
    for i, (got, mine) in enumerate(zip(received, local, strict=True)):
        check_tensor(f"{name}[{i}]", got, mine, max_rel_distance)


def clamp_weight(weight: float, max_weight: float) -> float:
    """Round weights are token counts: never negative, never above what one peer can plausibly process."""
    if weight != weight:  # NaN
        return 0.0
    return float(min(max(weight, 0.0), max_weight))
