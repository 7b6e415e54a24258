"""Prints of weight copies: a few hundred values at fixed positions, to tell whether two peers' copies of
the same weights are near each other without moving either copy.

    p = copy_print(expert_tensors(model, 3))           # PRINT_VALUES fp32 values, the same positions on
    blob = print_bytes(p)                              # every peer (seeded by the shapes); 1 KB as fp16
    q = print_from_bytes(blob)                         # None unless it is a well-formed, finite print
    reference = median_print([q1, q2])                 # what most peers hold, coordinate by coordinate
    why = copy_doubt([p], [reference])                 # "" for a plausible copy, else the reason

A copy that travelled from one peer is the whole truth for a downloader that holds nothing better; prints
served by other peers are the swarm's view of the same weights. Positions are uniform over the copy's
values, so a print's norm and its distance from another print estimate (up to sampling noise, a few
percent at 512 values) the copies' own; a negated, zeroed or scaled copy is told at once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

PRINT_VALUES = 512
# A copy is doubted when its norm is off by more than this factor from the reference's, or when it points
# away from it (cosine below MIN_COSINE). Honest copies a round or two apart differ in norm by a few
# percent; an expert's norm grew 1.7-1.9x over the demo's first 200 steps, and a copy that old still had
# cosine 0.3 with its successor (measured): the bounds leave room for a stale reference.
NORM_FACTOR = 2.0
MIN_COSINE = 0.0
# ...but a copy many steps newer than ours may have grown more. AdamW moves a coordinate by about the
# learning rate per step at most, so k steps move a copy by at most k * lr * sqrt(numel) and its norm ratio
# to ours is at most 1 + k * lr / rms(ours): far above 2 early in training, when our copy is still near its
# initialisation. Measured: on GPU peers (H100, the wide shape of benchmarks/wan.py, lr 3e-3) experts' norms
# were 2.0-2.1x their initialisation's after 340-400 steps and 3.05x after 1200; on 2 cores at lr 1e-2,
# 2.25-3.4x after 50-180 steps. With the fixed factor every such refresh was refused and the copy stayed at
# its initialisation. The factor allowed is that bound, at least NORM_FACTOR and at most MAX_NORM_FACTOR;
# the direction check and the fetch's outlier check (one copy changing far more than the others) still
# hold. Steps are what the peers say: the cap bounds what a holder that claims a huge step gains by it.
MAX_NORM_FACTOR = 8.0


def norm_factor(steps_apart: int | None, lr: float | None, rms: float) -> float:
    """How far in norm an honest copy ``steps_apart`` AdamW steps at learning rate ``lr`` (at most) newer
    than a reference of root-mean-square value ``rms`` may be off it (NORM_FACTOR where unknown)."""
    if not steps_apart or steps_apart < 0 or not lr or not rms > 0:
        return NORM_FACTOR
    return min(MAX_NORM_FACTOR, max(NORM_FACTOR, 1.0 + steps_apart * lr / rms))


def rms(tensors: Sequence[torch.Tensor]) -> float:
    """The root-mean-square value over a group of tensors (a copy, or its print)."""
    total = sum(float(torch.linalg.vector_norm(t.detach().float())) ** 2 for t in tensors)
    return (total / max(1, sum(t.numel() for t in tensors))) ** 0.5


@functools.lru_cache(maxsize=64)
def _positions(numels: tuple[int, ...], n: int) -> tuple[torch.Tensor, ...]:
    total = sum(numels)
    seed = int.from_bytes(hashlib.sha256(repr(numels).encode()).digest()[:8], "little") & (2**63 - 1)
    flat = torch.randint(total, (min(n, total),), generator=torch.Generator().manual_seed(seed)).sort().values
    out, start = [], 0
    for numel in numels:
        mine = flat[(flat >= start) & (flat < start + numel)]
        out.append(mine - start)
        start += numel
    return tuple(out)


def copy_print(tensors: Sequence[torch.Tensor], n: int = PRINT_VALUES) -> torch.Tensor:
    """The values of ``tensors`` (any device, any float dtype) at positions fixed by their shapes: fp32 on
    the host."""
    where = _positions(tuple(t.numel() for t in tensors), n)
    parts = [
        t.detach().reshape(-1).index_select(0, i.to(t.device)) for t, i in zip(tensors, where, strict=True)
    ]
    return torch.cat([p.to("cpu", torch.float32) for p in parts])


def print_bytes(p: torch.Tensor) -> bytes:
    return p.to(torch.float16).numpy().tobytes()


def print_from_bytes(blob: object, n: int = PRINT_VALUES) -> torch.Tensor | None:
    """A print as another peer served it, or None when it is not ``n`` finite fp16 values."""
    if not isinstance(blob, bytes) or len(blob) != 2 * n:
        return None
    p = torch.from_numpy(np.frombuffer(blob, dtype=np.float16).astype(np.float32))
    return p if bool(torch.isfinite(p).all()) else None


def median_print(prints: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median (the mean of the middle two for an even count)."""
    return torch.quantile(torch.stack(list(prints)), 0.5, dim=0)


def copy_doubt(
    new: Sequence[torch.Tensor],
    ref: Sequence[torch.Tensor],
    factor: float = NORM_FACTOR,
    min_cos: float = MIN_COSINE,
) -> str:
    """Why ``new`` cannot be a later version of ``ref`` (whole copies or their prints), or "" when it can:
    its norm is more than ``factor`` times off, or it points away from ``ref``."""
    dot = sum(
        float((a.float() * b.detach().to(a.device).float()).sum()) for a, b in zip(new, ref, strict=True)
    )
    n_new = sum(float(a.float().pow(2).sum()) for a in new) ** 0.5
    n_ref = sum(float(b.detach().float().pow(2).sum()) for b in ref) ** 0.5
    return norm_doubt(n_new, n_ref, dot, factor, min_cos)


def norm_doubt(
    n_new: float, n_ref: float, dot: float, factor: float = NORM_FACTOR, min_cos: float = MIN_COSINE
) -> str:
    """``copy_doubt``'s rule on sums already taken (``tensor_checks.CopyComparison``): the norms of the new
    copy and of the reference, and their dot product."""
    if n_ref == 0.0:
        return ""  # nothing to compare with
    ratio = n_new / n_ref
    if not 1 / factor <= ratio <= factor:
        return f"its norm is {ratio:.3g}x the reference's"
    cos = dot / (n_new * n_ref)
    if cos < min_cos:
        return f"it points away from the reference (cosine {cos:.2f})"
    return ""
