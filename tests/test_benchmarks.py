"""Smoke tests of benchmarks/memory.py and benchmarks/step_speed.py at a tiny shape (seconds, no speed asserts).

Each script runs as a subprocess with ``--tiny --json``; the tests check the exit code and the ratios the
JSON reports. Timings are never asserted (the machine is shared and noisy): only that they were measured.
The memory ratio in tensor accounting is deterministic, so it is checked against the arithmetic prediction.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


def test_memory_benchmark_tiny():
    r = _run("memory.py", *"--tiny --layers 1 --threads 1 --json".split())
    assert r["shape"]["n_layers"] == 1 and r["shape"]["local_experts"] == 4
    assert [row["variant"] for row in r["rows"]] == ["all", "local-fp32", "local-bf16"]
    ratios = {q["frozen_dtype"]: q for q in r["ratios"]}
    assert set(ratios) == {"float32", "bfloat16"}
    for q in ratios.values():
        assert 0 < q["predicted"] < 1
        assert abs(q["tensor_rel_diff"]) <= 0.05 and q["tensor_pass"]
        assert q["rss"] > 0  # measured; RSS at a tiny shape is dominated by allocator noise: not asserted
    assert ratios["bfloat16"]["predicted"] < ratios["float32"]["predicted"]
    for row in r["rows"]:  # the tensor accounting is exact up to the small non-weight buffers
        assert 0 <= row["tensor_bytes"] - row["predicted_bytes"] < 4096


def test_step_speed_benchmark_tiny():
    args = "--tiny --layers 1 --threads 1 --warmup 1 --rounds 2 --json".split()
    r = _run("step_speed.py", *args)
    assert r["hf_experts_implementation"] == "grouped_mm"
    assert r["expert_ops"]["hf-olmoe"].get("aten._grouped_mm", 0) >= 2
    assert r["loss_difference"] < 1e-4  # same weights, same batch, same loss
    assert set(r["variants"]) == {"ours-all", "ours-4of16", "hf-olmoe"}
    for v in r["variants"].values():
        assert len(v["times_s"]) == 2 and all(t > 0 for t in v["times_s"])
    for key, goal in (("ours_vs_hf", 1.1), ("local_vs_all", 0.9)):
        q = r["ratios"][key]
        assert q["goal"] == goal
        assert math.isfinite(q["ratio_of_medians"]) and q["ratio_of_medians"] > 0
