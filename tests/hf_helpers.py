"""Shared pieces of the Hugging Face export / upcycle / eval tests: a tiny trained run, subprocess helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from swarm.config import config_from_dict
from swarm.train import Trainer
from tests.conftest import ROOT, TINY_CONFIG

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def tiny_run(run_dir: Path, data_dir: Path, steps: int = 10, **model) -> Path:
    """Train the tiny config for ``steps`` steps (checkpoint and val_loss at the last one); return run_dir."""
    raw = {
        **TINY_CONFIG,
        "model": {**TINY_CONFIG["model"], **model},
        "data": {**TINY_CONFIG["data"], "path": str(data_dir)},
    }
    raw["train"] = {**raw["train"], "eval_every": steps, "checkpoint_every": steps}
    trainer = Trainer(config_from_dict(raw), run_dir, progress=False)
    trainer.setup()
    trainer.train(max_steps=steps)
    trainer.close()
    return run_dir


_READ_ONLY_RUNS: dict[Path, Path] = {}


def read_only_tiny_run(tmp_path_factory, data_dir: Path) -> Path:
    """``tiny_run`` of the default 10 steps, made once per session and shared by the modules whose tests
    only read it (test_eval, test_hf_export): a test that changes a run works on a copy."""
    if data_dir not in _READ_ONLY_RUNS:
        _READ_ONLY_RUNS[data_dir] = tiny_run(tmp_path_factory.mktemp("run") / "run", data_dir)
    return _READ_ONLY_RUNS[data_dir]


def write_config(path: Path, data_dir: Path, **sections) -> Path:
    raw = {**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(data_dir)}, **sections}
    path.write_text(yaml.safe_dump(raw))
    return path


def last_val_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def run_python(code: str, *args: str, timeout: float = 300, env: dict | None = None):
    """``python -c code args`` offline, from the repo root."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **OFFLINE, **(env or {})},
    )


def peer_here(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """``swarm-peer --no-progress ARGS`` offline in this process (no interpreter and torch start-up): its exit
    code, stdout and stderr. The SIGTERM handler and torch's thread count it sets are restored."""
    import signal

    import torch

    from peers.main import main as peer_main

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()  # only this run's output
    handler, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    try:
        code = peer_main(["--no-progress", *args])
    finally:
        signal.signal(signal.SIGTERM, handler)
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]
