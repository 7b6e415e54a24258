"""The MoE transformer: HF OLMoE parity, expert subsets (bytes, gradients, frozen weights), determinism."""

import pytest
import torch

from swarm.config import ModelConfig, TrainConfig, config_from_dict
from swarm.model import MoETransformer
from swarm.model.hf_olmoe import from_olmoe_state_dict, olmoe_config, to_olmoe_state_dict
from swarm.train import build_optimizer, training_state_bytes
from swarm.train.optimizer import load_optimizer_tensors, optimizer_tensors

SMALL = dict(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_experts=16, expert_hidden=32, top_k=2, max_seq_len=64
)


def _model(local=None, frozen="float32", **kw) -> MoETransformer:
    m = MoETransformer(ModelConfig(**{**SMALL, **kw}), local, frozen)
    m.init_weights(seed=7)
    return m


@pytest.mark.parametrize(
    "kw", [{}, {"n_kv_heads": 2, "norm_topk_prob": True, "top_k": 4}, {"tie_embeddings": True}]
)
def test_logits_match_transformers_olmoe(kw):
    from transformers import OlmoeForCausalLM

    ours = _model(local=[0, 3, 5, 9], **kw).eval()
    hf = OlmoeForCausalLM(olmoe_config(ours.cfg, pad_token_id=None, eos_token_id=None)).eval()
    hf.load_state_dict(to_olmoe_state_dict(ours.canonical_state_dict()), strict=True)
    x = torch.randint(0, ours.cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(x[:, :-1], targets=x[:, 1:])
        logits = ours(x[:, :-1]).logits
        b = hf(x[:, :-1], labels=x[:, :-1], output_router_logits=True)
    assert logits.shape == b.logits.shape
    assert (logits - b.logits).abs().max().item() < 1e-4
    # the chunked loss is the cross-entropy of HF's logits
    want = torch.nn.functional.cross_entropy(b.logits.reshape(-1, b.logits.shape[-1]), x[:, 1:].reshape(-1))
    assert abs(a.lm_loss.item() - want.item()) < 1e-5
    # HF's aux loss is the same load-balancing formula
    assert abs(a.lb_loss.item() - b.aux_loss.item()) < 1e-5
    assert from_olmoe_state_dict(hf.state_dict()).keys() >= ours.canonical_state_dict().keys() - {
        "lm_head.weight"
    }


def test_init_is_independent_of_local_experts():
    a = _model(local=[0, 1, 2, 3]).canonical_state_dict()
    b = _model(local=[12, 13, 14, 15], frozen="bfloat16").canonical_state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if ".experts." in k:  # bf16 frozen copies are the fp32 init rounded to bf16
            assert torch.equal(a[k].bfloat16().float()[:4], b[k][:4])
            assert torch.equal(a[k][12:], b[k][12:])
        else:
            assert torch.equal(a[k], b[k]), k


def test_subset_model_computes_the_same_function():
    full = _model()
    sub = _model(local=[2, 5, 11, 14])
    x = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        assert torch.allclose(full(x).logits, sub(x).logits, atol=1e-5)


def _train_steps(model, steps=3):
    opt = build_optimizer(model, TrainConfig())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 33), generator=gen)
        out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
        opt.step()
    return opt


def test_four_of_sixteen_holds_state_only_for_dense_and_local_experts():
    local = [1, 4, 7, 10]
    model = _model(local=local)
    before = model.canonical_state_dict()
    opt = _train_steps(model)
    after = model.canonical_state_dict()

    cfg = model.cfg
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    per_expert = cfg.n_layers * (3 * cfg.expert_hidden * cfg.d_model)
    trainable = dense + len(local) * per_expert
    got = training_state_bytes(model, opt)
    assert got["trainable"] == 4 * trainable
    assert got["grads"] == 4 * trainable  # gradients exist only for dense + 4 experts
    # AdamW: exp_avg + exp_avg_sq per trainable element, plus one scalar step per parameter tensor
    n_tensors = len(model.trainable_parameters())
    assert got["optimizer"] == 4 * 2 * trainable + 4 * n_tensors
    assert {id(p) for p in opt.state} == {id(p) for p in model.trainable_parameters()}
    assert all(".experts." not in n or "_local" in n for n, p in model.named_parameters())

    for key in before:
        if ".experts." in key:
            frozen = [e for e in range(cfg.n_experts) if e not in local]
            assert torch.equal(before[key][frozen], after[key][frozen]), "a frozen expert changed"
            assert not torch.equal(before[key][local], after[key][local]), "a local expert did not train"
        else:
            assert not torch.equal(before[key], after[key]), f"dense {key} did not train"


def test_frozen_experts_still_receive_tokens_and_pass_gradients():
    model = _model(local=[0])
    x = torch.randint(0, 256, (4, 33))
    out = model(x[:, :-1], targets=x[:, 1:])
    assert out.expert_tokens.sum().item() == 4 * 32 * model.cfg.top_k * model.cfg.n_layers
    assert (out.expert_tokens[1:] > 0).any()
    out.loss.backward()
    # routers see every expert, so their gradient covers the frozen experts' rows too
    assert model.layers[0].moe.gate.weight.grad[1:].abs().sum() > 0


def test_bf16_frozen_experts_halve_frozen_bytes():
    fp32 = training_state_bytes(_model(local=[0, 1, 2, 3]))
    bf16 = training_state_bytes(_model(local=[0, 1, 2, 3], frozen="bfloat16"))
    cfg = ModelConfig(**SMALL)
    frozen_elems = 12 * cfg.n_layers * 3 * cfg.expert_hidden * cfg.d_model
    assert fp32["frozen"] - bf16["frozen"] == 2 * frozen_elems


def test_set_local_experts_keeps_weights():
    model = _model(local=[0, 1])
    ref = model.canonical_state_dict()
    model.set_local_experts([5, 6, 7])
    assert model.local_experts == [5, 6, 7]
    for k, v in model.canonical_state_dict().items():
        assert torch.equal(v, ref[k])
    assert len(model.local_expert_parameters()) == 2 * model.cfg.n_layers


def test_config_rejects_out_of_range_experts():
    with pytest.raises(ValueError, match="experts.local"):
        config_from_dict({"model": {"n_experts": 4}, "experts": {"local": [0, 4]}})


def test_vocabulary_is_padded_inside_only():
    model = _model(local=[0, 1], vocab_size=250)
    assert model.padded_vocab == 256 and model.lm_head.weight.shape[0] == 256
    state = model.canonical_state_dict()
    assert state["embed.weight"].shape[0] == 250 and state["lm_head.weight"].shape[0] == 250
    assert model.canonical_shapes()["lm_head.weight"] == (250, model.cfg.d_model)
    x = torch.randint(0, 250, (2, 17))
    assert model(x).logits.shape == (2, 17, 250)
    opt = _train_steps_vocab(model, 250)
    assert model.embed.weight[250:].abs().max().item() == 0
    assert model.lm_head.weight[250:].abs().max().item() == 0  # padding rows never learn
    assert all(opt.state[model.lm_head.weight][k][250:].abs().max() == 0 for k in ("exp_avg", "exp_avg_sq"))
    # a canonical state round-trips, padding rows included
    other = _model(local=[0, 1], vocab_size=250)
    other.load_canonical_state_dict(model.canonical_state_dict())
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    # so do the optimizer moments a checkpoint holds: saved at the true size, padded again on load
    saved = optimizer_tensors(model, opt)
    assert saved["lm_head.weight/exp_avg"].shape == (250, model.cfg.d_model)
    other_opt = build_optimizer(other, TrainConfig())
    load_optimizer_tensors(other, other_opt, saved)
    for slot in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(other_opt.state[other.lm_head.weight][slot], opt.state[model.lm_head.weight][slot])


def _train_steps_vocab(model, vocab, steps=2):
    opt = build_optimizer(model, TrainConfig())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, vocab, (4, 33), generator=gen)
        model(x[:, :-1], targets=x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_subset_gradients_equal_the_full_models():
    """One grouped GEMM over both banks, differentiated for the local bank only, gives the same gradients
    as a peer that trains every expert."""
    local = [2, 5, 11, 14]
    full, sub = _model(), _model(local=local)
    x = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(3))
    for m in (full, sub):
        m(x[:, :-1], targets=x[:, 1:]).loss.backward()
    for layer in range(full.cfg.n_layers):
        f, s = full.layers[layer].moe.experts, sub.layers[layer].moe.experts
        assert (f.gate_up_local.grad[local] - s.gate_up_local.grad).abs().max().item() < 1e-6
        assert (f.down_local.grad[local] - s.down_local.grad).abs().max().item() < 1e-6
        fa, sa = full.layers[layer].attn.q_proj.weight.grad, sub.layers[layer].attn.q_proj.weight.grad
        assert (fa - sa).abs().max().item() < 1e-6  # input gradients flow through frozen experts alike


def test_activation_checkpointing_gives_the_same_gradients():
    plain = _model(local=[0, 1, 2])
    ckpt = MoETransformer(plain.cfg, [0, 1, 2], activation_checkpointing=True)
    ckpt.load_canonical_state_dict(plain.canonical_state_dict())
    x = torch.randint(0, 256, (2, 33))
    a = plain(x[:, :-1], targets=x[:, 1:])
    b = ckpt(x[:, :-1], targets=x[:, 1:])
    a.loss.backward(), b.loss.backward()
    assert a.loss.item() == b.loss.item()
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_the_model_compiles_as_one_graph():
    """torch.compile sees no graph break anywhere, the MoE layers included (no host sync)."""
    model = _model(local=[1, 4], vocab_size=250, n_experts=8)
    x = torch.randint(0, 250, (2, 33))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x[:, :-1], targets=x[:, 1:])
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
