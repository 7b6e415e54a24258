"""A round's host memory by arithmetic: the element counts match the model, the totals the issue's figures."""

import pytest
import torch

from swarm.config import ModelConfig, load_config
from swarm.model import MoETransformer
from swarm.net.expert_tensors import dense_tensors, expert_tensors, snapshot
from swarm.net.round_memory import dense_elements, expert_elements, held_bytes, round_host_bytes

SHAPES = [
    dict(vocab_size=250, d_model=64, n_layers=2, n_heads=4, n_experts=8, expert_hidden=32),
    dict(
        vocab_size=256,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        n_experts=4,
        expert_hidden=16,
        tie_embeddings=True,
        qk_norm="per_head",
    ),
    dict(vocab_size=300, d_model=32, n_layers=1, n_heads=2, n_experts=4, expert_hidden=8, qk_norm="none"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_element_counts_match_the_tensors_a_round_moves(shape):
    cfg = ModelConfig(**shape)
    model = MoETransformer(cfg, [0, 1], "bfloat16")
    assert dense_elements(cfg) == sum(t.numel() for t in dense_tensors(model))  # no vocabulary padding
    assert all(expert_elements(cfg) == sum(t.numel() for t in expert_tensors(model, e)) for e in range(4))
    # a round holds fp32 snapshots of the averaged tensors and the results, and fp16 downloads
    want = 4 * 2 * (dense_elements(cfg) + 2 * expert_elements(cfg)) + 2 * 2 * expert_elements(cfg)
    assert held_bytes(cfg, 2, averaged=2, downloaded=2) == want


def test_snapshots_are_host_fp32_whatever_the_source():
    cfg = ModelConfig(**SHAPES[0])
    model = MoETransformer(cfg, [0], "bfloat16")
    model.init_weights(0)
    frozen = expert_tensors(model, 3)
    assert frozen[0].dtype == torch.bfloat16
    copies = snapshot(frozen)
    assert all(c.dtype == torch.float32 and c.device.type == "cpu" for c in copies)
    assert all(torch.equal(c, f.float()) for c, f in zip(copies, frozen, strict=True))


def test_spes_shapes_no_longer_copy_the_frozen_experts():
    cfg = load_config("configs/spes-1b.yaml").model
    parts = round_host_bytes(cfg, 4)
    # 12 non-local experts of spes-1b: 2.7 GB as an fp32 snapshot, 1.36 GB as fp16 downloads
    assert abs(parts.frozen_snapshot_before / 1e9 - 2.72) < 0.01
    assert abs(parts.downloads / 1e9 - 1.36) < 0.01
    assert parts.round_total == parts.round_total_before - parts.frozen_snapshot_before - parts.downloads
