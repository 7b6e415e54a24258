"""The local trainer through ``swarm-peer``: learning, exact resume, kills during checkpoint writes."""

import json
import os
import signal
import subprocess
import time

import pytest

from swarm.train import load_checkpoint
from swarm.train.checkpoint import latest_checkpoint, list_checkpoints
from swarm.train.metrics_log import read_metrics
from tests.conftest import ROOT, peer_cmd, run_peer


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_solo_peer_learns_and_writes_metrics(tiny_config, tmp_path):
    run = tmp_path / "run"
    res = run_peer("--config", str(tiny_config), "--solo", "--run-dir", str(run), "--max-steps", "60")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss"] < 0.93 * summary["initial_val_loss"]
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 61))
    for key in ("step", "tokens", "loss", "lr", "tokens_per_s"):
        assert key in train[-1]
    assert train[-1]["tokens"] == 60 * 4 * 32
    assert sum("val_loss" in r for r in records) == 1 + 6  # step 0 and every 10 steps
    assert (run / "config.yaml").exists()
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ckpt.step == 60 and ckpt.state["local_experts"] == [0, 1]
    assert len(list_checkpoints(run / "checkpoints")) == 3  # keep_checkpoints


def test_resume_reproduces_uninterrupted_run(tiny_config, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert (
        run_peer(
            "--config", str(tiny_config), "--solo", "--run-dir", str(full), "--max-steps", "40"
        ).returncode
        == 0
    )
    assert (
        run_peer(
            "--config", str(tiny_config), "--solo", "--run-dir", str(part), "--max-steps", "20"
        ).returncode
        == 0
    )
    res = run_peer(
        "--config", str(tiny_config), "--solo", "--run-dir", str(part), "--max-steps", "40", "--resume"
    )
    assert res.returncode == 0, res.stderr
    a, b = _losses(full), _losses(part)
    assert sorted(b) == list(range(1, 41))
    assert max(abs(a[s] - b[s]) for s in range(21, 41)) <= 1e-5


@pytest.mark.parametrize("point", ["model_written", "optimizer_written", "before_rename", "before_prune"])
def test_kill_during_checkpoint_write_leaves_loadable_latest(tiny_config, tmp_path, point):
    """SIGKILL at each point of writing checkpoint 30; the latest checkpoint still loads, and --resume
    reproduces an uninterrupted run over the next 20 steps."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert (
        run_peer(
            "--config", str(tiny_config), "--solo", "--run-dir", str(ref), "--max-steps", "50"
        ).returncode
        == 0
    )
    res = run_peer(
        "--config",
        str(tiny_config),
        "--solo",
        "--run-dir",
        str(run),
        "--max-steps",
        "50",
        env={"SWARM_FAULT_KILL_AT": f"{point}@30"},
    )
    assert res.returncode == -signal.SIGKILL
    latest = latest_checkpoint(run / "checkpoints")
    ckpt = load_checkpoint(latest)  # never raises: the visible latest is always complete
    assert ckpt.step == (30 if point == "before_prune" else 20)
    res = run_peer(
        "--config", str(tiny_config), "--solo", "--run-dir", str(run), "--max-steps", "50", "--resume"
    )
    assert res.returncode == 0, res.stderr
    a, b = _losses(ref), _losses(run)
    start = ckpt.step + 1
    assert max(abs(a[s] - b[s]) for s in range(start, start + 20)) <= 1e-5
    assert not list((run / "checkpoints").glob(".tmp-*")), "stale temporaries were not cleaned"


def test_sigkill_at_random_moments_never_breaks_latest(tiny_config, tmp_path):
    run = tmp_path / "run"
    for i, delay in enumerate((2.5, 3.1, 3.7)):
        cmd = peer_cmd(
            "--config",
            str(tiny_config),
            "--solo",
            "--run-dir",
            str(run),
            "--max-steps",
            "100000",
            "--resume",
            "--set",
            "train.checkpoint_every=1",
            "--set",
            "train.eval_every=1000",
        )
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay + i)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        latest = latest_checkpoint(run / "checkpoints")
        if latest is not None:
            load_checkpoint(latest)
    assert latest is not None


def test_sigterm_writes_a_checkpoint(tiny_config, tmp_path):
    run = tmp_path / "run"
    cmd = peer_cmd(
        "--config",
        str(tiny_config),
        "--solo",
        "--run-dir",
        str(run),
        "--max-steps",
        "100000",
        "--set",
        "train.checkpoint_every=100000",
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(_losses(run)) > 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert load_checkpoint(latest_checkpoint(run / "checkpoints")).step >= 3


def _train_solo(config, run_dir, steps: int) -> None:
    res = run_peer("--config", str(config), "--solo", "--run-dir", str(run_dir), "--max-steps", str(steps))
    assert res.returncode == 0, res.stderr[-2000:]


def _one_error_line(res):
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_bad_config_values_exit_2(tiny_config, tmp_path):
    line = _one_error_line(run_peer("--config", str(tiny_config), "--solo", "--set", "train.lr=-1"))
    assert "train.lr" in line
    line = _one_error_line(run_peer("--config", str(tiny_config), "--solo", "--set", "model.n_headz=3"))
    assert "model.n_headz" in line
    line = _one_error_line(run_peer("--config", str(tiny_config), "--solo", "--set", "model.d_model=abc"))
    assert "model.d_model" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    assert "not valid YAML" in _one_error_line(run_peer("--config", str(bad), "--solo"))
    assert "not found" in _one_error_line(run_peer("--config", str(tmp_path / "nope.yaml"), "--solo"))


def test_missing_tokenizer_exit_2(tiny_config, tmp_path):
    line = _one_error_line(
        run_peer(
            "--config",
            str(tiny_config),
            "--solo",
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            f"data.tokenizer={tmp_path / 'missing.json'}",
        )
    )
    assert "missing.json" in line


def test_corrupt_shard_exit_2(tiny_config, tiny_data, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = sorted(data.glob("train_*.npy"))[0]
    with open(shard, "r+b") as fh:  # truncate the shard to half its size
        fh.truncate(os.path.getsize(shard) // 2)
    line = _one_error_line(
        run_peer(
            "--config",
            str(tiny_config),
            "--solo",
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            f"data.path={data}",
        )
    )
    assert shard.name in line


def test_corrupt_checkpoint_exit_2_and_is_kept(tiny_config, tmp_path):
    run = tmp_path / "run"
    _train_solo(tiny_config, run, 10)
    latest = latest_checkpoint(run / "checkpoints")
    (latest / "model.safetensors").write_bytes(b"garbage")
    line = _one_error_line(
        run_peer("--config", str(tiny_config), "--solo", "--run-dir", str(run), "--resume")
    )
    assert "corrupt" in line and latest.name in line
    assert (latest / "model.safetensors").exists()  # nothing already saved is deleted


def test_other_model_in_run_dir_is_refused(tiny_config, tmp_path):
    run = tmp_path / "run"
    _train_solo(tiny_config, run, 2)
    line = _one_error_line(
        run_peer("--config", str(tiny_config), "--solo", "--run-dir", str(run), "--set", "model.d_model=64")
    )
    assert "different model config" in line


def test_existing_checkpoints_need_resume(tiny_config, tmp_path):
    run = tmp_path / "run"
    _train_solo(tiny_config, run, 10)
    before = read_metrics(run / "metrics.jsonl")
    line = _one_error_line(run_peer("--config", str(tiny_config), "--solo", "--run-dir", str(run)))
    assert "--resume" in line
    assert read_metrics(run / "metrics.jsonl") == before  # nothing saved was touched


def test_megablocks_backend_on_cpu_exit_2(tiny_config, tmp_path):
    line = _one_error_line(
        run_peer(
            "--config",
            str(tiny_config),
            "--solo",
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            "model.moe_backend=megablocks",
        )
    )
    assert "megablocks" in line and "CUDA" in line
