"""Which expert kernels a model's forward + backward runs, checked before step_speed.py times anything.

    ops = expert_ops(variant)                    # {"aten._grouped_mm": 8, ...}: grouped-GEMM ops only
    check_hf_grouped_mm(hf_variant, n_layers)    # exits unless HF OLMoE ran torch's grouped_mm kernel

A timing of HF OLMoE means nothing if transformers fell back to a Python loop over experts: the op count
says which kernels ran.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from benchmarks.step_speed import Variant


class OpCounter(TorchDispatchMode):
    """Counts the ATen / custom ops that run (forward and backward) while active. ``TorchDispatchMode`` is
    the mechanism of torch's own ``FlopCounterMode``; it also sees transformers' custom fallback op."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def expert_ops(v: Variant) -> dict[str, int]:
    """Run one forward + backward (no optimizer step) and count the grouped-GEMM ops it used."""
    with OpCounter() as counter:
        v.loss_fn().backward()
    v.optimizer.zero_grad()
    keep = ("grouped_mm", "bmm", "fallback")
    return {k: n for k, n in sorted(counter.counts.items()) if any(s in k for s in keep)}


def check_hf_grouped_mm(hf: Variant, n_layers: int) -> dict[str, int]:
    impl = hf.model.config._experts_implementation
    if impl != "grouped_mm":
        raise SystemExit(f"HF OLMoE runs experts_implementation={impl!r}, not grouped_mm")
    ops = expert_ops(hf)
    native = ops.get("aten._grouped_mm", 0)
    fallback = sum(n for k, n in ops.items() if "fallback" in k)
    if native < 2 * n_layers or fallback:
        raise SystemExit(f"HF OLMoE did not run torch's grouped_mm kernel for its experts: ops {ops}")
    return ops
