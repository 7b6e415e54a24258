from pathlib import Path

import pytest
import torch

from swarm.config import ConfigError, load_config
from swarm.train import Trainer, load_checkpoint
from swarm.train.checkpoint import latest_checkpoint
from swarm.train.metrics_log import read_metrics
from swarm.train.pooled_moment import PooledMomentAdamW, clip_scale
from swarm.train.sync_hook import Pools, SyncReply
from tests.trainer_fixtures import _losses

BETAS = (0.9, 0.95)


def test_a_pool_of_one_is_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40, 10))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1)
    ours = PooledMomentAdamW([b], lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1, pool=1)
    for _ in range(30):
        g = torch.randn(40, 10)
        a.grad, b.grad = g.clone(), g / 2
        ours.mark_half()  # a pool of 1 ignores the halves
        b.grad = g.clone()
        ref.step()
        ours.step()
    assert torch.allclose(a, b, atol=1e-6)


def _displacement(kind: str, replicas: int = 4, steps: int = 100, n: int = 5000) -> float:
    """The mean distance moved along the true gradient (1 on every coordinate) by replicas whose weights
    are averaged after every step, each on its own batch of two halves with noise of sd 4 (sd 2 for the
    batch's mean): ``central`` is one AdamW on the replicas' pooled gradient."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(n)) for _ in range(replicas)]
    if kind == "central":
        opts = [torch.optim.AdamW([params[0]], lr=1e-3, betas=BETAS, weight_decay=0.0)]
    elif kind == "adamw":
        opts = [torch.optim.AdamW([p], lr=1e-3, betas=BETAS, weight_decay=0.0) for p in params]
    else:
        opts = [PooledMomentAdamW([p], lr=1e-3, betas=BETAS, pool=replicas) for p in params]
    for _ in range(steps):
        halves = 1.0 + 8**0.5 * torch.randn(replicas, 2, n, generator=gen)
        if kind == "central":
            params[0].grad = halves.mean(dim=(0, 1))
            opts[0].step()
            continue
        for i, (p, opt) in enumerate(zip(params, opts, strict=True)):
            p.grad = halves[i, 0] / 2
            if kind == "pooled":
                opt.mark_half()
            p.grad = halves[i].mean(dim=0)
            opt.step()
        with torch.no_grad():
            mean = torch.stack([p.detach() for p in params]).mean(dim=0)
            for p in params:
                p.copy_(mean)
    return -float(params[0].detach().mean())


def test_averaged_replicas_step_as_far_as_adamw_on_the_pooled_batch():
    central = _displacement("central")
    pooled = _displacement("pooled")
    plain = _displacement("adamw")
    # each replica's own second moment is (1 + 4) against the pooled batch's (1 + 1): sqrt(2/5) = 0.63
    assert plain / central == pytest.approx(0.63, abs=0.05)
    assert pooled / central == pytest.approx(1.0, abs=0.08)


def test_clipping_after_the_half_scales_the_noise_estimate_too():
    torch.manual_seed(0)
    g, half = torch.randn(100), torch.randn(100) / 2
    states = []
    for scale in (1.0, 0.25):
        p = torch.nn.Parameter(torch.zeros(100))
        opt = PooledMomentAdamW([p], lr=1e-3, pool=4)
        p.grad = half.clone()
        opt.mark_half()
        p.grad = g * scale  # what clipping leaves
        opt.step(grad_scale=scale)
        states.append(opt.state[p])
    assert torch.allclose(states[1]["noise_sq"], states[0]["noise_sq"] * 0.25**2, rtol=1e-5)
    assert torch.allclose(states[1]["exp_avg_sq"], states[0]["exp_avg_sq"] * 0.25**2, rtol=1e-5)


def test_clip_scale_returns_the_factor_applied():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    assert clip_scale([p], 1.0) == pytest.approx(0.2, rel=1e-5)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    assert clip_scale([p], 10.0) == 1.0
    assert clip_scale([p], 0.0) == 1.0


def test_a_pool_below_one_is_refused():
    with pytest.raises(ValueError, match="pool"):
        PooledMomentAdamW([torch.nn.Parameter(torch.zeros(1))], pool=0.5)


def test_set_pools_sizes_each_group_by_its_experts_tag_and_zero_grad_drops_an_unused_half():
    dense, expert = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = PooledMomentAdamW([{"params": [dense], "experts": False}, {"params": [expert], "experts": True}])
    opt.set_pools(4, 2)
    assert [g["pool"] for g in opt.param_groups] == [4.0, 2.0]
    opt.set_pools(0, 1)  # never below one replica
    assert [g["pool"] for g in opt.param_groups] == [1.0, 1.0]
    dense.grad = torch.ones(3)
    opt.mark_half()
    opt.zero_grad()  # a skipped step: its half must not pair with the next step's gradient
    assert "half" not in opt.state[dense]


class _Pools:
    """A sync hook that says four peers train and two hold our experts."""

    def after_step(self, model, report):
        return SyncReply(pools=Pools(dense=4, experts=2))

    def last_round(self, model, report):
        return []

    def experts_changed(self, model):
        pass

    def close(self):
        pass


def _train(config: Path, run_dir: Path, steps: int, overrides: list[str], resume: bool = False) -> Trainer:
    trainer = Trainer(load_config(config, overrides), run_dir, sync=_Pools(), progress=False)
    trainer.setup(resume=resume)
    try:
        trainer.train(max_steps=steps)
    finally:
        trainer.close()
    return trainer


def test_a_trainer_with_pooled_moment_takes_the_hooks_pools_learns_and_resumes_exactly(tiny_config, tmp_path):
    """The tiny config (micro-batch 4, one accumulation step): each step's two halves of 2 windows."""
    on = ["train.pooled_moment=true", "train.checkpoint_every=6", "train.eval_every=6"]
    full = _train(tiny_config, tmp_path / "full", 12, on)
    assert [g["pool"] for g in full.optimizer.param_groups] == [2.0 if g["experts"] else 4.0
                                                                for g in full.optimizer.param_groups]  # fmt: skip
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "full" / "checkpoints"))
    noise = {k: v for k, v in ckpt.optimizer.items() if k.endswith("/noise_sq")}
    assert noise and all(torch.isfinite(v).all() and (v >= 0).all() for v in noise.values())
    assert any(k.startswith("experts_") or "_local" in k for k in noise)  # experts pooled too (2 holders)
    assert ckpt.state["pools"] == [4, 2]
    logged = [
        (r["step"], r["pools"]) for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "pools" in r
    ]
    assert logged == [(1, {"dense": 4, "experts": 2})]  # once: they never changed
    losses = _losses(tmp_path / "full")
    assert losses[12] < losses[1]
    _train(tiny_config, tmp_path / "split", 6, on)
    _train(tiny_config, tmp_path / "split", 12, on, resume=True)
    resumed = _losses(tmp_path / "split")
    assert [resumed[s] for s in range(7, 13)] == [losses[s] for s in range(7, 13)]
    plain = _losses(_train(tiny_config, tmp_path / "plain", 12, on[1:]).run_dir)
    assert plain[12] != losses[12]


def test_pooled_moment_needs_an_even_number_of_windows_per_step(tiny_config):
    with pytest.raises(ConfigError, match="train.pooled_moment: needs an even number"):
        load_config(tiny_config, ["train.pooled_moment=true", "data.micro_batch=3"])
    load_config(tiny_config, ["train.pooled_moment=true", "data.micro_batch=3", "train.grad_accum=2"])


def test_a_solo_trainer_with_pooled_moment_steps_as_plain_adamw(tiny_config, tmp_path):
    """Pools of 1 (no swarm): no halves, the same steps as torch's AdamW up to rounding."""
    runs = {}
    for name, sets in {"pooled": ["train.pooled_moment=true"], "plain": []}.items():
        trainer = Trainer(load_config(tiny_config, sets), tmp_path / name, progress=False)
        trainer.setup()
        try:
            trainer.train(max_steps=8)
        finally:
            trainer.close()
        runs[name] = _losses(tmp_path / name)
    assert runs["pooled"].keys() == runs["plain"].keys()
    for step, loss in runs["plain"].items():
        assert runs["pooled"][step] == pytest.approx(loss, rel=1e-4), step
