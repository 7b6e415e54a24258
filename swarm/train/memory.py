"""Byte accounting of a peer's training state: parameters, gradients and optimizer moments."""

from __future__ import annotations

import torch


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def training_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes held by trainable parameters, frozen weights (buffers), gradients and optimizer state.

    Counts distinct storages once (tied embeddings are not double counted)."""
    seen: set[int] = set()

    def unique(ts):
        for t in ts:
            key = t.untyped_storage().data_ptr()
            if t.numel() and key not in seen:
                seen.add(key)
                yield t

    trainable = _nbytes(unique(p for p in model.parameters() if p.requires_grad))
    frozen = _nbytes(unique([*(p for p in model.parameters() if not p.requires_grad), *model.buffers()]))
    grads = _nbytes(unique(p.grad for p in model.parameters() if p.grad is not None))
    opt = 0
    if optimizer is not None:
        opt = _nbytes(unique(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)))
    return {
        "trainable": trainable,
        "frozen": frozen,
        "grads": grads,
        "optimizer": opt,
        "total": trainable + frozen + grads + opt,
    }
