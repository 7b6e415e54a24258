"""The sampler (swarm.data.sampler): training windows, exact resume, seeds, fixed validation batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.data import DataError, TokenDataset, WindowSampler, validation_batches


def test_sampler_batches_resume_and_seeds(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    sampler = WindowSampler(dataset, seq_len=32, batch_size=4, seed=7)
    first = sampler.next_batch()
    assert first.dtype == torch.long and first.shape == (4, 33)
    # Every row is a real window of some shard.
    shards = [np.asarray(s, dtype=np.int64) for s in dataset.train_shards]
    for row in first.numpy():
        assert any(
            np.array_equal(s[i : i + 33], row)
            for s in shards
            for i in np.flatnonzero(s[: len(s) - 32] == row[0])
        )
    for _ in range(3):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))  # survives JSON
    expected = [sampler.next_batch() for _ in range(5)]
    resumed = WindowSampler(dataset, seq_len=32, batch_size=4, seed=12345)
    resumed.load_state_dict(state)
    assert resumed.batches == 4
    for batch in expected:
        assert torch.equal(resumed.next_batch(), batch)
    same = WindowSampler(dataset, seq_len=32, batch_size=4, seed=7)
    other = WindowSampler(dataset, seq_len=32, batch_size=4, seed=8)
    assert torch.equal(same.next_batch(), first)
    assert not torch.equal(other.next_batch(), first)
    with pytest.raises(DataError, match="seq_len=32"):
        WindowSampler(dataset, seq_len=16, batch_size=4, seed=7).load_state_dict(state)


def test_sampler_too_little_data(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    with pytest.raises(DataError, match="too little training data"):
        WindowSampler(dataset, seq_len=5000, batch_size=2, seed=0)


def test_validation_batches_are_fixed_consecutive_windows(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    batches = validation_batches(dataset, seq_len=16, batch_size=3, max_batches=4)
    assert len(batches) == 4 and all(b.shape == (3, 17) and b.dtype == torch.long for b in batches)
    flat = torch.cat(batches).reshape(-1).numpy()
    assert np.array_equal(flat, np.asarray(dataset.val[: 4 * 3 * 17], dtype=np.int64))
    again = validation_batches(TokenDataset.open(prepared), seq_len=16, batch_size=3, max_batches=4)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    with pytest.raises(DataError, match="validation split"):
        validation_batches(dataset, seq_len=len(dataset.val), batch_size=1)
