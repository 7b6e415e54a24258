"""Random training windows (resumable) and fixed validation windows over a ``TokenDataset``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from swarm.data.dataset import TokenDataset
from swarm.data.errors import DataError

_STATE_VERSION = 1


class WindowSampler:
    """Draw batches of random ``seq_len + 1`` token windows from the training shards.

    Usage::

        sampler = WindowSampler(dataset, seq_len=256, batch_size=8, seed=peer_seed)
        batch = sampler.next_batch()              # LongTensor [8, 257]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        state = sampler.state_dict()              # JSON/msgpack-safe; store with the checkpoint
        sampler.load_state_dict(state)            # the following batches repeat exactly

    Every possible window is equally likely (shards are weighted by their number of start
    positions). Windows may cross document boundaries; the EOS ids mark them. Each peer
    passes its own seed, so peers see different streams.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, batch_size: int, seed: int):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.batches = 0
        self._train_tokens = dataset.train_tokens
        window = seq_len + 1
        self._shards = [shard for shard in dataset.train_shards if len(shard) >= window]
        if not self._shards:
            longest = max((len(shard) for shard in dataset.train_shards), default=0)
            raise DataError(
                f"too little training data in {dataset.data_dir}: no shard has seq_len + 1 = {window} tokens "
                f"(longest has {longest}); use a shorter sequence length or more data"
            )
        starts = np.array([len(shard) - window + 1 for shard in self._shards], dtype=np.int64)
        self._first_start = np.cumsum(starts) - starts  # global index of each shard's first window
        self._total_starts = int(starts.sum())
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self) -> torch.Tensor:
        """Return a LongTensor of shape ``[batch_size, seq_len + 1]``."""
        window = self.seq_len + 1
        positions = self._rng.integers(0, self._total_starts, size=self.batch_size, dtype=np.int64)
        shard_ids = np.searchsorted(self._first_start, positions, side="right") - 1
        batch = np.empty((self.batch_size, window), dtype=np.int64)
        for row, (shard_id, position) in enumerate(zip(shard_ids.tolist(), positions.tolist(), strict=True)):
            offset = position - int(self._first_start[shard_id])
            batch[row] = self._shards[shard_id][offset : offset + window]
        self.batches += 1
        return torch.from_numpy(batch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The sampler position: plain ints and strings only (PCG64's 128-bit words as hex)."""
        state = self._rng.bit_generator.state
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "train_tokens": self._train_tokens,
            "batches": self.batches,
            # Hex strings because 128-bit integers overflow msgpack and most JSON parsers.
            "pcg64": {
                "state": hex(state["state"]["state"]),
                "inc": hex(state["state"]["inc"]),
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by ``state_dict``; DataError if it belongs to another setup."""
        try:
            if state["version"] != _STATE_VERSION:
                raise DataError(f"sampler state has version {state['version']}, expected {_STATE_VERSION}")
            for key, mine in (
                ("seq_len", self.seq_len),
                ("batch_size", self.batch_size),
                ("train_tokens", self._train_tokens),
            ):
                if state[key] != mine:
                    raise DataError(
                        f"sampler state was saved with {key}={state[key]}, this sampler has {mine}"
                    )
            pcg = state["pcg64"]
            self._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(pcg["state"], 16), "inc": int(pcg["inc"], 16)},
                "has_uint32": int(pcg["has_uint32"]),
                "uinteger": int(pcg["uinteger"]),
            }
            self.seed = state["seed"]
            self.batches = int(state["batches"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"malformed sampler state: {exc!r}") from exc


def validation_batches(
    dataset: TokenDataset, seq_len: int, batch_size: int, max_batches: int | None = None
) -> list[torch.Tensor]:
    """Consecutive, non-overlapping ``seq_len + 1`` windows of the validation shard, batched.

    The result depends only on the dataset and the arguments, so every peer evaluates on the
    same tokens. Only full batches are returned, except when the shard holds fewer than
    ``batch_size`` windows: then a single smaller batch is returned. DataError if the shard is
    shorter than one window.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    window = seq_len + 1
    windows = len(dataset.val) // window
    if windows == 0:
        raise DataError(
            f"validation split of {dataset.data_dir} has {len(dataset.val)} tokens, fewer than "
            f"seq_len + 1 = {window}; prepare with a larger val fraction"
        )
    count = max(1, windows // batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    rows = min(batch_size, windows)
    tokens = np.asarray(dataset.val[: count * rows * window], dtype=np.int64)
    return [torch.from_numpy(batch.copy()) for batch in tokens.reshape(count, rows, window)]
