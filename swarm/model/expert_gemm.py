"""Grouped GEMMs for expert weights: torch's native ``grouped_mm`` by default, megablocks on request.

``grouped_linear(x, w, counts)`` computes, for consecutive row groups of ``x`` (group g has ``counts[g]`` rows),
``x_g @ w[g].T``; ``w`` is [G, out, in] like ``nn.Linear`` weights stacked per expert.

``split_bank_linear(x, w_local, w_frozen, counts)`` does the same over the concatenation of a
trainable bank and a frozen one (rows of local experts first) in ONE grouped GEMM, and differentiates only the
local bank: the weight gradient is a grouped GEMM over the local rows alone (``grouped_mm`` ignores rows past
its last offset in that form). Splitting the rows instead would need their count on the host, a device sync
and a ``torch.compile`` graph break in every MoE layer.

The grouped GEMMs are wrapped as ``torch.library`` custom ops with their own shape functions: torch 2.13's
meta kernel for ``grouped_mm`` accepts only bf16, so an fp32 model (on CPU) could not be compiled otherwise,
and a custom op is one opaque node for the compiler whatever the dtype.
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


# -- grouped GEMMs as custom ops -----------------------------------------------------------------------------
@torch.library.custom_op("swarm::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[g-1]:offs[g] of ``x`` [M, K] times ``w[g]`` [K, N]; ``offs[-1]`` must equal M."""
    return F.grouped_mm(x, w, offs=offs)


@grouped_matmul.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("swarm::grouped_weight_grad", mutates_args=())
def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, N, K]: dy_g^T @ x_g over the row groups of ``offs``; rows past ``offs[-1]`` are left out."""
    return F.grouped_mm(dy.t(), x, offs=offs)


@grouped_weight_grad.register_fake
def _(dy, x, offs):
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


def _grouped_matmul_backward(ctx, dy):
    x, w, offs = ctx.saved_tensors
    dx = grouped_matmul(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_weight_grad(x, dy, offs) if ctx.needs_input_grad[1] else None  # [G, K, N] like w
    return dx, dw, None


def _grouped_matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


grouped_matmul.register_autograd(_grouped_matmul_backward, setup_context=_grouped_matmul_setup)


class _SplitBankLinear(torch.autograd.Function):
    """y = x_g @ cat(w_local, w_frozen)[g].T per row group; gradients for x and w_local only."""

    @staticmethod
    def forward(ctx, x, w_local, w_frozen, offs, offs_local):
        ctx.save_for_backward(x, w_local, w_frozen, offs, offs_local)
        w = torch.cat([w_local.to(x.dtype), w_frozen.to(x.dtype)])
        return grouped_matmul(x, w.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, dy):
        x, w_local, w_frozen, offs, offs_local = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w = torch.cat([w_local.to(dy.dtype), w_frozen.to(dy.dtype)])
            dx = grouped_matmul(dy, w, offs)
        if ctx.needs_input_grad[1]:
            dw = grouped_weight_grad(dy, x.to(dy.dtype), offs_local).to(w_local.dtype)
        return dx, dw, None, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # grouped GEMMs are not autocast-aware: cast by hand so bf16 autocast covers the experts too
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, backend: str = "grouped_mm"
) -> torch.Tensor:
    """Every row group of ``x`` through its own expert weight (one bank); returns ``x``'s dtype, or the
    autocast dtype."""
    dtype = _compute_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    if backend == "megablocks":
        return _megablocks_gmm()(x, w, counts.cpu(), trans_b=True)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return grouped_matmul(x, w.transpose(-2, -1), offs)


def split_bank_linear(
    x: torch.Tensor, w_local: torch.Tensor, w_frozen: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``grouped_linear`` over [local experts..., frozen experts...] with ``counts`` for all of them in that
    order; only ``w_local`` receives a gradient."""
    dtype = _compute_dtype(x)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    offs_local = offs[: w_local.shape[0]]
    return _SplitBankLinear.apply(x.to(dtype), w_local, w_frozen, offs, offs_local)
