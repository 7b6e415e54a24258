"""TokenDataset.open (swarm.data.dataset): its properties; corrupt files are one-line DataErrors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from swarm.data import DataError, TokenDataset


def test_dataset_open_properties(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared, verify=True)
    assert dataset.vocab_size <= 400 and dataset.eos_id == 0 and dataset.dtype == np.uint16
    assert dataset.train_tokens == sum(len(s) for s in dataset.train_shards) > 0
    assert dataset.val_tokens == len(dataset.val) > 0
    assert len(dataset.tokenizer_sha256) == 64


def _open_error(path: Path, verify: bool = False) -> str:
    with pytest.raises(DataError) as info:
        TokenDataset.open(path, verify=verify)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_shard_is_a_data_error(prepared: Path) -> None:
    shard = prepared / "train_00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-200])
    assert "shard train_00001.npy is corrupt: expected 1500 tokens, found 1400" in _open_error(prepared)


def test_garbage_shard_is_a_data_error(prepared: Path) -> None:
    shard = prepared / "train_00000.npy"
    size = shard.stat().st_size
    shard.write_bytes(np.random.default_rng(0).bytes(size))
    assert "shard train_00000.npy is corrupt: not a valid .npy file" in _open_error(prepared)


def test_overwritten_token_bytes_are_caught(prepared: Path) -> None:
    shard = prepared / "train_00000.npy"
    data = bytearray(shard.read_bytes())
    data[200:204] = b"\x01\x00\x02\x00"  # valid ids, same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    TokenDataset.open(prepared)  # cheap checks pass
    assert "sha256 does not match" in _open_error(prepared, verify=True)
    data[-2:] = b"\xff\xff"  # id 65535 >= vocab size: caught by the cheap id check
    shard.write_bytes(bytes(data))
    assert "token id 65535 >= vocab size" in _open_error(prepared)


def test_manifest_and_tokenizer_problems(prepared: Path, tmp_path: Path) -> None:
    assert "no manifest.json" in _open_error(tmp_path)
    manifest = json.loads((prepared / "manifest.json").read_text())
    (prepared / "manifest.json").write_text(json.dumps(manifest | {"dtype": "float32"}))
    assert "dtype 'float32'" in _open_error(prepared)
    (prepared / "manifest.json").write_text(json.dumps(manifest | {"train": [{"file": "../x.npy"}]}))
    assert "missing field" in _open_error(prepared)
    (prepared / "manifest.json").write_text("{")
    assert "not valid JSON" in _open_error(prepared)
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    (prepared / "val.npy").unlink()
    assert "shard val.npy is missing" in _open_error(prepared)
    (prepared / "tokenizer.json").write_text("{}")
    assert "does not match the manifest" in _open_error(prepared)
