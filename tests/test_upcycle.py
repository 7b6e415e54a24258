"""swarm-upcycle: an MoE grown from a tiny dense Llama / Qwen3 computes exactly what the dense model did."""

import json
import shutil

import pytest
import torch

from swarm.hf.export import export_checkpoint
from swarm.hf.run_checkpoint import open_run_checkpoint
from swarm.hf.upcycle import main as upcycle_main
from swarm.model import MoETransformer
from tests.hf_helpers import error_lines, peer_here, write_config

SHAPE = dict(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _dense(kind: str, path, tiny_data, **extra):
    """A randomly initialised tiny dense model (norms away from 1) saved with the tiny tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    cfg_cls, model_cls = classes[kind]
    extra = {"head_dim": 8, **extra} if kind == "qwen3" else extra
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(path)
    shutil.copy(tiny_data / "tokenizer.json", path / "tokenizer.json")
    return model


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize(
    "kind, extra, arch",
    [
        ("llama", {}, "MixtralForCausalLM"),
        ("qwen3", {"tie_word_embeddings": True}, "Qwen3MoeForCausalLM"),
    ],
)
def test_upcycled_model_equals_the_dense_one(kind, extra, arch, tmp_path, tiny_data):
    from transformers import AutoModelForCausalLM

    dense = _dense(kind, tmp_path / "dense", tiny_data, **extra)
    assert (
        upcycle_main([str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2"]) == 0
    )
    ck = open_run_checkpoint(tmp_path / "moe")
    m = ck.cfg.model
    assert (m.n_experts, m.top_k, m.expert_hidden, m.norm_topk_prob) == (4, 2, 48, True)
    assert m.qk_norm == ("per_head" if kind == "qwen3" else "none") and m.tie_embeddings == (kind == "qwen3")
    for layer in range(2):
        assert not ck.state[f"layers.{layer}.moe.gate.weight"].any()  # zero router
        gate_up = ck.state[f"layers.{layer}.moe.experts.gate_up"]
        mlp = dense.model.layers[layer].mlp
        assert torch.equal(gate_up[3], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))

    moe = MoETransformer(m, [0, 1]).eval()
    moe.load_canonical_state_dict(ck.state)
    x = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(5))
    assert (_logits(moe, x) - _logits(dense, x)).abs().max().item() < 1e-4

    # and out through the export, as the HF MoE class that keeps these q/k norms
    rep = export_checkpoint(tmp_path / "moe", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert rep.architecture == arch == type(hf).__name__
    assert (_logits(hf, x) - _logits(dense, x)).abs().max().item() < 1e-4


def test_noise_touches_the_asked_fraction(tmp_path, tiny_data):
    dense = _dense("llama", tmp_path / "dense", tiny_data)
    args = ["--experts", "4", "--noise-std", "0.1", "--noise-fraction", "0.25", "--router-std", "0.02"]
    assert upcycle_main([str(tmp_path / "dense"), str(tmp_path / "moe"), *args]) == 0
    st = open_run_checkpoint(tmp_path / "moe").state
    down = dense.model.layers[0].mlp.down_proj.weight.detach()
    experts = st["layers.0.moe.experts.down"]
    changed = [(experts[e] != down).float().mean().item() for e in range(4)]
    assert all(0.2 < c < 0.3 for c in changed), changed
    assert not torch.equal(experts[0], experts[1])  # copies are perturbed independently
    delta = (experts[0] - down)[experts[0] != down]
    assert 0.05 < (delta.std() / down.std()).item() < 0.2  # std 0.1 of the matrix's own std
    assert st["layers.0.moe.gate.weight"].std().item() == pytest.approx(0.02, rel=0.3)
    assert torch.equal(st["layers.0.attn.q_proj.weight"], dense.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize(
    "kind, extra, message",
    [
        ("qwen2", {}, "q/k/v biases"),
        ("qwen3", {"head_dim": 16}, "head_dim 16"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "RoPE scaling",
        ),
        ("llama", {"attention_bias": True}, "biases"),
    ],
)
def test_refuses_what_the_model_cannot_represent(kind, extra, message, tmp_path, tiny_data, capsys):
    _dense(kind, tmp_path / "dense", tiny_data, **extra)
    assert upcycle_main([str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "4"]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "moe").exists()


def test_refuses_bad_arguments(tmp_path, tiny_data, capsys):
    _dense("llama", tmp_path / "dense", tiny_data)
    for args in (
        [str(tmp_path / "missing"), str(tmp_path / "o1"), "--experts", "4"],
        [str(tmp_path / "dense"), str(tmp_path / "o2"), "--experts", "1", "--top-k", "2"],
        [str(tmp_path / "dense"), str(tmp_path / "o3"), "--experts", "4", "--noise-fraction", "2"],
    ):
        assert upcycle_main(args) == 2
        assert len(error_lines(capsys.readouterr().err)) == 1
    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "x").write_text("keep")
    assert upcycle_main([str(tmp_path / "dense"), str(tmp_path / "o4"), "--experts", "4"]) == 2
    assert (tmp_path / "o4" / "x").read_text() == "keep"


def test_swarm_peer_trains_from_the_upcycled_checkpoint(tmp_path, tiny_data, capsys, monkeypatch):
    import torch.nn.functional as F

    from swarm.data import TokenDataset, validation_batches

    dense = _dense("llama", tmp_path / "dense", tiny_data)
    base = write_config(tmp_path / "tiny.yaml", tiny_data)
    args = ["--experts", "4", "--config", str(base), "--set", "experts.per_peer=2"]
    assert upcycle_main([str(tmp_path / "dense"), str(tmp_path / "moe"), *args]) == 0
    code, out, err = peer_here(
        capsys, monkeypatch, "--config", str(tmp_path / "moe" / "config.yaml"), "--solo",
        "--run-dir", str(tmp_path / "train"), "--init-from", str(tmp_path / "moe"), "--max-steps", "3",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["end_step"] == 3 and "initialised the model from" in err
    # step 0 validates the dense model's function: same loss on the same validation windows
    batches = validation_batches(TokenDataset.open(tiny_data), 32, 4, 2)
    want = sum(
        F.cross_entropy(_logits(dense, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).item() for b in batches
    )
    assert summary["initial_val_loss"] == pytest.approx(want / len(batches), abs=1e-4)
