"""Data layer: tokenizers, corpus preparation into ``.npy`` token shards, and batch sampling.

Typical use::

    from swarm.data import TokenDataset, WindowSampler, ensure_stdlib_dataset, validation_batches

    data_dir = ensure_stdlib_dataset()                 # or a directory made by `swarm-data prepare`
    dataset = TokenDataset.open(data_dir)
    sampler = WindowSampler(dataset, seq_len=256, batch_size=8, seed=peer_seed)
    batch = sampler.next_batch()                       # LongTensor [8, 257]
    val = validation_batches(dataset, seq_len=256, batch_size=8, max_batches=16)

Every bad input raises ``DataError`` with a one-line message.
"""

from __future__ import annotations

from typing import Any

from swarm.data.dataset import TokenDataset
from swarm.data.errors import DataError
from swarm.data.manifest import Manifest
from swarm.data.prepare import prepare
from swarm.data.stdlib_corpus import ensure_stdlib_dataset
from swarm.data.tokenizer import eos_id, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "DataError",
    "Manifest",
    "TokenDataset",
    "WindowSampler",
    "ensure_stdlib_dataset",
    "eos_id",
    "load_tokenizer",
    "prepare",
    "train_bpe_tokenizer",
    "validation_batches",
]

_SAMPLER_NAMES = ("WindowSampler", "validation_batches")


def __getattr__(name: str) -> Any:
    # The sampler needs torch (~1.5 s to import). Importing it lazily keeps `swarm-data` and,
    # above all, every spawned tokenizer worker process (which imports this package) fast.
    if name in _SAMPLER_NAMES:
        from swarm.data import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
