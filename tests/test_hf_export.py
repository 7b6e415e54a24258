"""swarm-export and swarm-peer --init-from: a checkpoint leaves as a HF model and comes back, exactly."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from swarm.config import config_from_dict, save_config
from swarm.hf.architectures import from_hf_state_dict, model_config_from_hf, model_differences
from swarm.hf.export import export_checkpoint
from swarm.hf.export import main as export_main
from swarm.hf.run_checkpoint import open_run_checkpoint, tokenizer_file
from swarm.model import MoETransformer
from swarm.train.checkpoint import save_checkpoint
from tests.conftest import TINY_CONFIG
from tests.hf_helpers import (
    error_lines,
    last_val_loss,
    peer_here,
    read_only_tiny_run,
    run_python,
    write_config,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    return read_only_tiny_run(tmp_path_factory, tiny_data)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert export_main([str(trained), str(out)]) == 0
    return out


def _ours(state, cfg) -> MoETransformer:
    model = MoETransformer(cfg).eval()
    model.load_canonical_state_dict(state)
    return model


def test_export_round_trip(trained, exported, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (exported / name).is_file(), name
    meta = json.loads((exported / "swarm_export.json").read_text())
    assert meta["step"] == 10 and meta["architecture"] == "OlmoeForCausalLM"
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["OlmoeForCausalLM"]

    ck = open_run_checkpoint(trained)
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(hf).__name__ == "OlmoeForCausalLM" and hf.dtype == torch.float32
    back = from_hf_state_dict(hf.state_dict(), ck.cfg.model)  # the weights come back bit for bit
    assert back.keys() == ck.state.keys()
    assert all(torch.equal(back[k], ck.state[k]) for k in back)
    x = torch.randint(0, 512, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(x).logits - _ours(ck.state, ck.cfg.model)(x).logits).abs().max().item()
    assert diff < 1e-4

    tok = AutoTokenizer.from_pretrained(exported)
    raw = Tokenizer.from_file(str(tokenizer_file(ck.cfg)))
    text = "def f(x):\n    return x + 1\n"
    assert tok(text).input_ids == raw.encode(text).ids and tok.decode(tok(text).input_ids) == text
    eot = raw.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == tok.pad_token_id == hf.config.eos_token_id == eot
    out = hf.generate(**tok(text, return_tensors="pt"), max_new_tokens=6, do_sample=False)
    assert out.shape[1] == len(tok(text).input_ids) + 6


def test_export_loads_offline_in_a_fresh_process(exported, tmp_path):
    code = (
        "import sys; from transformers import AutoModelForCausalLM as M, AutoTokenizer as T\n"
        "m, t = M.from_pretrained(sys.argv[1]), T.from_pretrained(sys.argv[1])\n"
        "ids = m.generate(**t('import os', return_tensors='pt'), max_new_tokens=5, do_sample=False)\n"
        "print('GENERATED', ids.shape[1] - len(t('import os').input_ids))\n"
    )
    # an empty HF cache: nothing can come from a previous download
    res = run_python(code, str(exported), env={"HF_HOME": str(tmp_path / "hf-home")})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "GENERATED 5" in res.stdout


@pytest.mark.parametrize(
    "model, arch",
    [
        ({"qk_norm": "per_head", "n_kv_heads": 2}, "Qwen3MoeForCausalLM"),
        ({"qk_norm": "none", "norm_topk_prob": True, "tie_embeddings": True}, "MixtralForCausalLM"),
        ({"tie_embeddings": True, "norm_topk_prob": True, "top_k": 3}, "OlmoeForCausalLM"),
    ],
)
def test_export_other_architectures(model, arch, tmp_path, tiny_data):
    from transformers import AutoModelForCausalLM

    cfg = config_from_dict(
        {
            **TINY_CONFIG,
            "model": {**TINY_CONFIG["model"], **model},
            "data": {**TINY_CONFIG["data"], "path": str(tiny_data)},
        }
    )
    net = MoETransformer(cfg.model, [0, 1])
    net.init_weights(seed=3)
    state = net.canonical_state_dict()
    gen = torch.Generator().manual_seed(2)
    for k in state:  # norms away from 1, so that where each norm sits matters
        if k.endswith("norm.weight"):
            state[k] = 1 + 0.3 * torch.randn(state[k].shape, generator=gen)
    (tmp_path / "run").mkdir()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    save_checkpoint(
        tmp_path / "run" / "checkpoints", 5, state, {}, {"tokens": 0, "fingerprint": cfg.fingerprint()}
    )
    rep = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    assert rep.architecture == arch and rep.max_abs_diff < 1e-4
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 512, (2, 40), generator=gen)
    with torch.no_grad():
        assert (hf(x).logits - _ours(state, cfg.model)(x).logits).abs().max().item() < 1e-4
    # and back, as --init-from reads it: same model config, same tensors
    assert model_differences(cfg.model, model_config_from_hf(hf.config)) == []
    back = from_hf_state_dict(hf.state_dict(), cfg.model)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in back)


def test_export_refuses_bad_input(trained, tmp_path, capsys):
    def fails(*args) -> str:
        assert export_main([str(a) for a in args]) == 2
        errors = error_lines(capsys.readouterr().err)
        assert len(errors) == 1
        return errors[0]

    assert "does not exist" in fails(tmp_path / "nope", tmp_path / "out")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert "not empty" in fails(trained, taken)
    assert (taken / "keep.txt").read_text() == "mine" and len(list(taken.iterdir())) == 1

    lone = tmp_path / "lone" / "step_00000010"  # a checkpoint without its run's config.yaml
    shutil.copytree(trained / "checkpoints" / "step_00000010", lone)
    assert "config.yaml" in fails(lone, tmp_path / "out")
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    weights = broken / "checkpoints" / "step_00000010" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "corrupt" in fails(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_peer_init_from_export_starts_from_those_weights(
    trained, exported, tmp_path, tiny_data, capsys, monkeypatch
):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_data)
    code, out, err = peer_here(
        capsys, monkeypatch, "--config", str(cfg), "--solo", "--run-dir", str(tmp_path / "r"),
        "--init-from", str(exported), "--max-steps", "0",
    )  # fmt: skip
    assert code == 0, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    # the same weights on the same validation windows: the source run's last val_loss
    assert abs(summary["initial_val_loss"] - last_val_loss(trained)) < 1e-5


def test_peer_init_from_refuses_another_model(exported, tmp_path, tiny_data, capsys):
    import signal

    from peers.main import main as peer_main

    cfg = write_config(tmp_path / "tiny.yaml", tiny_data)
    run_dir = tmp_path / "r"
    args = [
        "--no-progress",
        "--config",
        str(cfg),
        "--solo",
        "--run-dir",
        str(run_dir),
        "--init-from",
        str(exported),
    ]
    handler = signal.getsignal(signal.SIGTERM)
    try:  # in-process: the refusal happens before any training
        assert peer_main([*args, "--set", "model.n_experts=4"]) == 2
        errors = error_lines(capsys.readouterr().err)
        assert len(errors) == 1 and "--init-from" in errors[0] and "n_experts: 4 vs 8" in errors[0]
        assert not (run_dir / "config.yaml").exists()  # refused before the run dir was written
        assert peer_main([*args[:-1], str(tmp_path / "nothing-here")]) == 2
        assert "does not exist" in error_lines(capsys.readouterr().err)[0]
    finally:
        signal.signal(signal.SIGTERM, handler)
