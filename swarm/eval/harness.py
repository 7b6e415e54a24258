"""Run lm-eval-harness (0.4.13) in-process on a local HF model directory and our task YAMLs.

Usage::

    raw = run_lm_eval(model_dir, tasks_dir, ["swarm_arc_easy"], limit=50, batch_size=1, device="cpu")
    table = collect_metrics(raw)     # {"arc_easy": {"acc": .., "acc_norm": .., "n": 50, "n_total": 570, ..}}

This is ``lm-eval run --model hf --model_args pretrained=DIR,dtype=float32 --include_path TASKS_DIR
--tasks ... --limit N --batch_size B --device D`` with lm-eval's default seeds, so that command gives
the same numbers (``lm_eval_command`` writes it out; tests/test_eval.py runs it and compares).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from swarm.eval.task_yamls import PREFIX

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def lm_eval_command(
    model_dir: Path, tasks_dir: Path, names: list[str], limit: int | None, batch_size: int, device: str
) -> list[str]:
    """The equivalent lm-eval command line (``python -m lm_eval``: the console script may be missing)."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf"]
    cmd += ["--model_args", f"pretrained={Path(model_dir).resolve()},dtype=float32"]
    cmd += ["--include_path", str(Path(tasks_dir).resolve()), "--tasks", ",".join(names)]
    cmd += ["--batch_size", str(batch_size), "--device", device]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in ["lm-eval", *cmd[3:]])


def run_lm_eval(
    model_dir: Path,
    tasks_dir: Path,
    names: list[str],
    limit: int | None = None,
    batch_size: int = 1,
    device: str = "cpu",
) -> dict[str, Any]:
    """lm-eval's results dict for ``names`` (tasks found in ``tasks_dir`` only), fully offline."""
    os.environ.update(OFFLINE_ENV)  # before lm_eval imports datasets / huggingface_hub
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # per-request chatter
    tm = TaskManager(include_path=str(Path(tasks_dir).resolve()), include_defaults=False)
    return simple_evaluate(
        model="hf",
        model_args={"pretrained": str(Path(model_dir).resolve()), "dtype": "float32"},
        tasks=names,
        task_manager=tm,
        limit=limit,
        batch_size=batch_size,
        device=device,
        log_samples=False,
    )


def collect_metrics(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task (without the ``swarm_`` prefix): metric values, stderr, documents used and available."""
    out = {}
    for name, values in raw["results"].items():
        task = name.removeprefix(PREFIX)
        row: dict[str, Any] = {}
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if filt == "none" and isinstance(value, (int, float)):
                row[metric] = float(value)
        counts = raw.get("n-samples", {}).get(name, {})
        row["n"] = int(counts.get("effective", 0))
        row["n_total"] = int(counts.get("original", 0))
        row["num_fewshot"] = int(raw.get("n-shot", {}).get(name, 0))
        out[task] = row
    return out
