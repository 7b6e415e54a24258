"""The data command line (swarm.data.cli) and the embedded stdlib corpus (swarm.data.stdlib_corpus);
the rest of the data layer: test_tokenizer, test_prepare, test_dataset, test_sampler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.data import TokenDataset
from swarm.data.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- CLI -------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(REPO_ROOT)}


def test_cli_corrupt_input_exits_2_with_one_error_line(corpus: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    result = subprocess.run(
        [sys.executable, "-m", "swarm.data.cli", "prepare", "--input", str(bad)]
        + ["--tokenizer", str(corpus["tokenizer"]), "--out", str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=_env(),
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.jsonl:2" in lines[0], result.stderr


def test_cli_round_trip_in_process(corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = tmp_path / "tok.json"
    inputs = ["--input", str(corpus["root"] / "*.jsonl"), "-i", str(corpus["root"] / "*.txt")]
    assert cli_main(["train-tokenizer", *inputs, "--vocab-size", "300", "--out", str(tok)]) == 0
    out = tmp_path / "data"
    args = ["prepare", *inputs, "--tokenizer", str(tok), "--out", str(out), "--workers", "1", "-q"]
    assert cli_main([*args, "--val-fraction", "0.2"]) == 0
    assert cli_main(["inspect", str(out), "--verify"]) == 0
    assert "sha256 verified" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no manifest.json")


# --- embedded stdlib corpus --------------------------------------------------------------------

_BUILD_SCRIPT = """
import logging, sys
from pathlib import Path
from swarm.data.stdlib_corpus import ensure_stdlib_dataset
logging.basicConfig(level=logging.INFO, format="%(message)s")
if __name__ == "__main__":
    print(ensure_stdlib_dataset(Path(sys.argv[1]), vocab_size=320, progress=False, max_files=25))
"""


def test_ensure_stdlib_dataset_concurrent_build_happens_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=_env(),
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    assert sum(err.count("building stdlib dataset") for _, err in results) == 1, results
    data_dir = Path(paths.pop())
    dataset = TokenDataset.open(data_dir, verify=True)
    assert dataset.vocab_size <= 320 and dataset.train_tokens > 0 and dataset.val_tokens > 0
    # Only the finished dataset and the lock file remain; a later call reuses it.
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [data_dir.name]
    from swarm.data import ensure_stdlib_dataset

    assert ensure_stdlib_dataset(cache, vocab_size=320, progress=False, max_files=25) == data_dir
