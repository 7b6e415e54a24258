"""AdamW whose second moment is the one a batch ``pool`` times larger would have: for replicas averaged.

Averaging the weights of ``N`` replicas, each after its own AdamW step on its own batch, moves less than
one AdamW step on the ``N`` batches pooled: each replica divides by the second moment of its own gradient,
which carries ``N`` times the noise variance of the pooled one. Per coordinate
``E[g_i^2] = mu^2 + s^2`` while the pooled gradient has ``mu^2 + s^2 / N``. Two halves of a replica's batch
give an unbiased estimate of ``s^2`` from its own data alone (``((g_a - g_b) / 2)^2``); its moving average
(``noise_sq``, with AdamW's ``beta2``) times ``1 - 1/N`` comes off AdamW's own second moment, so each replica
divides by the pooled batch's second moment without sending anything more::

    opt = PooledMomentAdamW(adamw_groups(model.named_parameters(), t), lr=t.lr, betas=t.betas, pool=4)
    (loss(first_half) / 2).backward()
    opt.mark_half()                      # the first half's gradient, kept
    (loss(second_half) / 2).backward()
    scale = clip_scale(params, t.grad_clip)
    opt.step(grad_scale=scale)

A group's ``pool`` (default the constructor's) is how many replicas average its parameters: an expert that
one peer trains has a pool of 1, which is plain AdamW. ``set_pools(dense, experts)`` sets them by the groups'
``experts`` tag (``adamw_groups``), as a swarm's membership changes. A step without ``mark_half`` leaves the
noise estimate as it is; ``zero_grad`` drops a kept half that no step used (a skipped step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PooledMomentAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        pool: float = 1.0,
    ):
        if pool < 1:
            raise ValueError(f"pool must be >= 1, got {pool}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "pool": pool}
        )

    def set_pools(self, dense: float, experts: float) -> None:
        """The replicas that average each group: ``experts`` for groups tagged ``experts``, else ``dense``."""
        for group in self.param_groups:
            group["pool"] = max(1.0, float(experts if group.get("experts") else dense))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for st in self.state.values():
            st.pop("half", None)

    @torch.no_grad()
    def mark_half(self) -> None:
        """Keep the gradients accumulated so far: the first half of the batch, already divided by two."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["half"] = p.grad.detach().clone()

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        """One AdamW step on ``p.grad``. ``grad_scale``: the factor that clipping applied to ``p.grad`` after
        ``mark_half`` (the kept half is scaled by it too)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd, pool = group["lr"], group["eps"], group["weight_decay"], group["pool"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                if "step" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                second = st["exp_avg_sq"]
                half = st.pop("half", None)
                if pool > 1 and (half is not None or "noise_sq" in st):
                    noise = st.setdefault("noise_sq", torch.zeros_like(p)).mul_(b2)
                    if half is not None:
                        # (g_a - g_b) / 2 from the kept g_a / 2 and g = (g_a + g_b) / 2: its square's mean
                        # is the noise variance of g
                        noise.add_((half * (2 * grad_scale) - g).square_(), alpha=1 - b2)
                    # the clamp on the averages, not on each step's estimate, which is noisy enough per
                    # coordinate to go negative: clamping each step kept two thirds of the excess
                    second = torch.maximum(second - (1 - 1 / pool) * noise, second / pool)
                t = st["step"].item()
                p.mul_(1 - lr * wd)
                denom = (second / (1 - b2**t)).sqrt_().add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**t))
        return loss


def clip_scale(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients' total norm to ``max_norm`` (0: no clipping) and return the factor applied."""
    if not max_norm:
        return 1.0
    return clip_factor(float(torch.nn.utils.clip_grad_norm_(list(params), max_norm)), max_norm)


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor by which ``clip_grad_norm_`` scaled gradients of total norm ``norm`` (inf: no clipping)."""
    return min(1.0, max_norm / (norm + 1e-6))
