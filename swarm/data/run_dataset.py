"""A run's token data, opened from its config.

    ds = open_dataset(cfg)     # data.path: a directory made by `swarm-data prepare`, or "stdlib"

``data.path: stdlib`` builds the embedded corpus on first use. The dataset must have been prepared with the
config's tokenizer (if one is named) and fit the model's vocabulary: otherwise one clear error.
"""

from __future__ import annotations

from pathlib import Path

from swarm.config import ConfigError, RunConfig
from swarm.data.dataset import TokenDataset
from swarm.data.errors import DataError
from swarm.data.manifest import file_sha256
from swarm.data.stdlib_corpus import ensure_stdlib_dataset
from swarm.data.tokenizer import load_tokenizer


def open_dataset(cfg: RunConfig, progress: bool = True) -> TokenDataset:
    """The run's token data; ``data.path: stdlib`` builds the embedded corpus on first use."""
    if cfg.data.path == "stdlib":
        path = ensure_stdlib_dataset(
            cfg.data.cache_dir, vocab_size=cfg.data.stdlib_vocab_size, progress=progress
        )
    else:
        path = Path(cfg.data.path)
    ds = TokenDataset.open(path)
    if cfg.data.tokenizer:
        tok = load_tokenizer(cfg.data.tokenizer)  # DataError if missing or unreadable
        if tok.get_vocab_size() != ds.vocab_size or file_sha256(cfg.data.tokenizer) != ds.tokenizer_sha256:
            raise DataError(f"tokenizer {cfg.data.tokenizer} is not the one {path} was prepared with")
    if ds.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's tokenizer "
            f"vocabulary ({ds.vocab_size}, {path})"
        )
    return ds
