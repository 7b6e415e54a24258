"""Grouped GEMM for expert weights: torch's native ``grouped_mm`` by default, megablocks on request.

``grouped_linear(x, w, counts)`` computes, for consecutive row groups of ``x`` (group g has ``counts[g]`` rows),
``x_g @ w[g].T``; ``w`` is [G, out, in] like ``nn.Linear`` weights stacked per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MEGABLOCKS_GMM = None


class BackendUnavailable(RuntimeError):
    """The configured MoE backend cannot run on this machine."""


def _megablocks_gmm():
    global _MEGABLOCKS_GMM
    if _MEGABLOCKS_GMM is None:
        try:
            from megablocks import grouped_gemm_util as gg  # imported only when selected in the config
        except Exception as e:  # ImportError, or megablocks_ops missing without CUDA
            raise BackendUnavailable(
                "model.moe_backend=megablocks needs the megablocks package with its CUDA ops "
                "(a separate torch 2.7 environment: pip install '.[gpu]'); import failed: "
                f"{type(e).__name__}: {e}. Use model.moe_backend=grouped_mm instead."
            ) from None
        if not gg.grouped_gemm_is_available():
            raise BackendUnavailable("model.moe_backend=megablocks: grouped_gemm kernels are not installed")
        _MEGABLOCKS_GMM = gg.ops.gmm
    return _MEGABLOCKS_GMM


def check_backend(name: str, device: torch.device) -> None:
    """Fail early (with a clear message) when the backend cannot run on ``device``."""
    if name == "megablocks":
        if device.type != "cuda":
            raise BackendUnavailable(
                "model.moe_backend=megablocks needs a CUDA device; use grouped_mm on CPU"
            )
        _megablocks_gmm()


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, backend: str = "grouped_mm"
) -> torch.Tensor:
    out_dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        # grouped GEMMs are not autocast-aware: cast by hand so bf16 autocast covers the experts too.
        compute = torch.get_autocast_dtype(x.device.type)
        x, w, out_dtype = x.to(compute), w.to(compute), compute
    elif x.dtype != w.dtype:  # frozen experts held in bf16 while the peer trains in fp32
        x = x.to(w.dtype)
    if backend == "megablocks":
        y = _megablocks_gmm()(x, w, counts.cpu(), trans_b=True)
    else:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return y.to(out_dtype)
