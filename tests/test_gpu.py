"""GPU path: bf16 autocast training steps and the megablocks backend. Skips cleanly without CUDA."""

import pytest
import torch

from swarm.config import ModelConfig, TrainConfig
from swarm.model import BackendUnavailable, MoETransformer, check_backend
from swarm.train import build_optimizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPE = dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_experts=8, expert_hidden=128, top_k=2)


def test_megablocks_on_cpu_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="megablocks"):
        check_backend("megablocks", torch.device("cpu"))


@cuda
@pytest.mark.parametrize("frozen", ["float32", "bfloat16"])
def test_bf16_autocast_step_trains_local_experts_only(frozen):
    model = MoETransformer(ModelConfig(**SHAPE), [0, 1], frozen)
    model.init_weights(0)
    model.cuda()
    before = model.canonical_state_dict()
    opt = build_optimizer(model, TrainConfig())
    x = torch.randint(0, 512, (4, 65), device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    assert losses[-1] < losses[0]
    after = model.canonical_state_dict()
    key = "layers.0.moe.experts.gate_up"
    assert torch.equal(before[key][2:], after[key][2:])
    assert not torch.equal(before[key][:2], after[key][:2])


@cuda
def test_gpu_matches_cpu_in_fp32():
    cpu = MoETransformer(ModelConfig(**SHAPE), [0, 1])
    cpu.init_weights(0)
    gpu = MoETransformer(ModelConfig(**SHAPE), [0, 1])
    gpu.init_weights(0)
    gpu.cuda()
    x = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        a = cpu(x).logits
        b = gpu(x.cuda()).logits.cpu()
    assert (a - b).abs().max().item() < 1e-3


@cuda
def test_megablocks_backend_matches_grouped_mm():
    try:
        check_backend("megablocks", torch.device("cuda"))
    except BackendUnavailable as e:
        pytest.skip(str(e))
    ref = MoETransformer(ModelConfig(**SHAPE), [0, 1, 2])
    ref.init_weights(0)
    mb = MoETransformer(ModelConfig(**SHAPE, moe_backend="megablocks"), [0, 1, 2])
    mb.init_weights(0)
    ref.cuda(), mb.cuda()
    x = torch.randint(0, 512, (2, 33), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert (ref(x).logits - mb(x).logits).abs().max().item() < 5e-2
