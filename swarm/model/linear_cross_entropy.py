"""The LM head and the cross-entropy in chunks of tokens, so fp32 logits of the whole batch never exist.

    loss = linear_cross_entropy(hidden, lm_head.weight, targets, vocab_size=V, chunk_tokens=1024)

equals ``F.cross_entropy((hidden @ weight.T)[:, :V].float(), targets)`` (mean over tokens; targets of
``IGNORE`` = -100 are left out, as there). With a vocabulary
of 151k, fp32 logits of 8 x 2048 tokens take 10 GB, and autograd would keep them for the backward pass. Here
each chunk's logits live only while that chunk is processed: the gradients with respect to the hidden states
and the weight are computed right away (softmax minus one-hot, the way fused kernels such as Liger's do it)
and the backward pass only scales them. Rows of ``weight`` past ``vocab_size`` (padding to a multiple of
128 for fast GEMM kernels) get -inf logits: they never win a softmax and their gradient is zero.
"""

from __future__ import annotations

import torch

IGNORE = -100


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logits = (h @ w.t()).float()
    if w.shape[0] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    return logits


def _chunk_loss(h, w, targets, keep, vocab_size: int):
    """A chunk's logits, their logsumexp, and the summed loss of its kept tokens (``targets`` clamped)."""
    logits = _chunk_logits(h, w, vocab_size)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits, lse, ((lse - logits.gather(1, targets)) * keep).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, chunk: int, dtype: torch.dtype):
        w = weight.to(dtype)
        valid = targets != IGNORE
        n = valid.sum().clamp(min=1)  # a tensor: no host sync
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            part = slice(start, start + chunk)
            hc, tc, keep = h[part].to(dtype), targets[part].clamp(min=0)[:, None], valid[part, None]
            logits, lse, loss = _chunk_loss(hc, w, tc, keep, vocab_size)
            total = total + loss
            g = torch.exp(logits - lse)  # softmax; d(mean loss)/d(logits) = (softmax - onehot) / n
            g.scatter_add_(1, tc, torch.full_like(lse, -1.0))
            g = (g * (keep / n)).to(dtype)
            grad_h[part] = (g @ w).to(h.dtype)
            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden`` [N, d] through the head ``weight`` [V_padded, d] against ``targets``
    [N]. Under autocast the matmuls run in the autocast dtype; the softmax is always fp32."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    chunk = chunk_tokens if chunk_tokens > 0 else max(1, hidden.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        with torch.autocast(device, enabled=False):
            return _LinearCrossEntropy.apply(hidden, weight, targets, vocab_size, chunk, dtype)
    w, valid = weight.to(dtype), targets != IGNORE
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        tc = targets[part].clamp(min=0)[:, None]
        total = total + _chunk_loss(hidden[part].to(dtype), w, tc, valid[part, None], vocab_size)[2]
    return total / valid.sum().clamp(min=1)
