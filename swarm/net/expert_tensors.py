"""Named views of the tensors a round exchanges: the dense weights (and which of them are the core ones), and
expert e's weights in every layer.

The swarm always moves the canonical form (fp32, one expert = its gate_up and down in each layer), whatever
the local split and the frozen dtype, so peers with different local experts exchange the same shapes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from swarm.model import MoETransformer
from swarm.model.transformer import VOCAB_ROWS

R = TypeVar("R")


def dense_names(model: MoETransformer) -> list[str]:
    return sorted(model.dense_parameters())


def core_index(model: MoETransformer) -> tuple[int, ...]:
    """Where the core dense weights (all but the token embeddings and output head) are in ``dense_tensors``."""
    return tuple(i for i, name in enumerate(dense_names(model)) if name not in VOCAB_ROWS)


def dense_tensors(model: MoETransformer) -> list[torch.Tensor]:
    """Views of the dense weights at canonical size (no vocabulary padding rows), sorted by name."""
    views = model.dense_tensors()
    return [views[n] for n in dense_names(model)]


def expert_tensors(model: MoETransformer, e: int) -> list[torch.Tensor]:
    """Views of expert e in every layer: [gate_up_0, down_0, gate_up_1, down_1, ...].

    For a local expert these are views of the trainable parameters (in-place updates reach the model); for
    a frozen one, views of the frozen buffers (possibly bf16)."""
    out = []
    for block in model.layers:
        bank = block.moe.experts
        if e in bank.local_ids:
            i = bank.local_ids.index(e)
            out += [bank.gate_up_local.detach()[i], bank.down_local.detach()[i]]
        else:
            i = bank.frozen_ids.index(e)
            out += [bank.gate_up_frozen[i], bank.down_frozen[i]]
    return out


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host fp32 copies, whatever the tensors' device and dtype (the swarm moves host tensors only). From a
    GPU the copies go asynchronously into pinned buffers, with one wait at the end."""
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=torch.float32, pin_memory=t.is_cuda)
        out.append(host.copy_(t.detach(), non_blocking=t.is_cuda))
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    return out


def host_float(t: torch.Tensor) -> torch.Tensor:
    """One tensor as host fp32 (a view when it already is one): for reading a frozen copy in place."""
    return t.detach().to("cpu", torch.float32)


def side_stream(device: torch.device):
    """A context on a new CUDA stream of ``device``; nothing on a CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def on_this_stream(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn``, to run on another thread on this thread's current CUDA stream (as it is now). Streams are
    per thread: another thread starts on the default stream, where each copy of a GPU tensor to the host
    waits for every kernel the training thread has queued, once per tensor (a round's downloads read a
    dozen experts' copies in place, several times each). Without CUDA in use, ``fn`` itself."""
    if not torch.cuda.is_initialized():
        return fn
    stream = torch.cuda.current_stream()

    @functools.wraps(fn)
    def run(*args, **kwargs) -> R:
        with torch.cuda.stream(stream):
            return fn(*args, **kwargs)

    return run


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def overwrite(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s.to(d.device, d.dtype))


def per_layer(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[gu0, dn0, gu1, dn1, ...] -> [(gu0, dn0), (gu1, dn1), ...]"""
    return list(zip(tensors[0::2], tensors[1::2], strict=True))
