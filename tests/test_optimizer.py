"""The peer's AdamW: which parameters it steps, at which learning rate (``train.expert_lr_scale``)."""

import torch

from swarm.config import ModelConfig, TrainConfig
from swarm.model import MoETransformer
from swarm.train import build_optimizer, set_lr
from swarm.train.optimizer import load_optimizer_tensors, optimizer_tensors, remap_expert_moments

SMALL = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_experts=8, expert_hidden=32, top_k=2)


def _one_step(expert_lr_scale: float) -> tuple[float, float]:
    """The largest change of a dense matrix and of a local expert after one AdamW step at lr 1e-3."""
    model = MoETransformer(ModelConfig(**SMALL), [1, 6], "float32")
    model.init_weights(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, TrainConfig(weight_decay=0.0, expert_lr_scale=expert_lr_scale))
    set_lr(opt, 1e-3)
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], targets=x[:, 1:]).loss.backward()
    opt.step()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    experts = max(v for n, v in moved.items() if ".experts." in n)
    dense = max(v for n, v in moved.items() if ".experts." not in n)
    return dense, experts


def test_the_experts_step_at_their_scaled_rate_and_the_dense_weights_at_the_schedules():
    # AdamW's first step moves a weight with a gradient by lr (its update is m / sqrt(v) = +-1)
    dense, experts = _one_step(3.0)
    assert abs(dense - 1e-3) < 1e-6 and abs(experts - 3e-3) < 3e-6
    dense, experts = _one_step(1.0)
    assert abs(dense - 1e-3) < 1e-6 and abs(experts - 1e-3) < 1e-6


def test_every_trainable_parameter_is_in_one_group_and_frozen_experts_in_none():
    model = MoETransformer(ModelConfig(**SMALL), [0, 5], "bfloat16")
    opt = build_optimizer(model, TrainConfig(expert_lr_scale=2.0))
    stepped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(stepped) == sorted(id(p) for p in model.trainable_parameters())
    set_lr(opt, 4e-4)
    scaled = [g for g in opt.param_groups if g["lr_scale"] != 1.0]
    assert len(scaled) == 1 and scaled[0]["lr"] == 8e-4
    assert {id(p) for p in scaled[0]["params"]} == {id(p) for p in model.local_expert_parameters().values()}


def test_an_expert_switch_keeps_the_kept_experts_moments_and_noise_and_zeroes_the_newcomers():
    """``train.pooled_moment``'s noise estimate moves with its expert like AdamW's moments."""
    model = MoETransformer(ModelConfig(**SMALL), [1, 6], "float32")
    model.init_weights(seed=3)
    opt = build_optimizer(model, TrainConfig(pooled_moment=True))
    opt.set_pools(4, 2)
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    (model(x[:2, :-1], targets=x[:2, 1:]).loss / 2).backward()
    opt.mark_half()
    (model(x[2:, :-1], targets=x[2:, 1:]).loss / 2).backward()
    opt.step()
    flat = optimizer_tensors(model, opt)
    banks = [k for k in flat if k.endswith("/noise_sq") and k.rpartition("/")[0].endswith("_local")]
    assert banks and all(flat[k].abs().sum() > 0 for k in banks)
    moved = remap_expert_moments(flat, [1, 6], [2, 6])  # 6 stays, now in row 1; 2 is new
    for key in banks + [k.replace("noise_sq", "exp_avg") for k in banks]:
        assert torch.equal(moved[key][1], flat[key][1]) and not moved[key][0].any(), key
    model.set_local_experts([2, 6])
    again = build_optimizer(model, TrainConfig(pooled_moment=True))
    load_optimizer_tensors(model, again, moved)
    assert torch.equal(optimizer_tensors(model, again)[banks[0]], moved[banks[0]])
