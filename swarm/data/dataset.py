"""``TokenDataset``: a validated, memory-mapped view of a prepared dataset directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from swarm.data.errors import DataError
from swarm.data.manifest import Manifest, ShardInfo, file_sha256

# Token ids are spot-checked against the vocabulary at both ends of every shard: cheap (a few
# hundred KB read) yet catches a shard from another tokenizer or bytes overwritten in place.
_ID_CHECK_TOKENS = 1 << 16


class TokenDataset:
    """Memory-mapped token shards described by a ``manifest.json``.

    Usage::

        dataset = TokenDataset.open("data/stdlib")       # DataError if anything is off
        dataset.vocab_size, dataset.eos_id, dataset.train_tokens, dataset.val_tokens
        dataset.train_shards[0][:10]                      # 1-D read-only np.memmap views
        dataset.val                                       # the held-out validation tokens

    ``open`` checks every shard against the manifest (header, dtype, length, file size and a
    sample of token ids) so a truncated or overwritten file fails here with a one-line
    DataError naming the shard, not later inside the training loop. ``verify=True`` also
    compares the sha256 of every shard (reads all the data once).
    """

    def __init__(self, data_dir: Path, manifest: Manifest, train_shards: list[np.ndarray], val: np.ndarray):
        self.data_dir = data_dir
        self.manifest = manifest
        self.train_shards = train_shards
        self.val = val

    @classmethod
    def open(cls, data_dir: str | Path, verify: bool = False) -> TokenDataset:
        root = Path(data_dir)
        if not root.is_dir():
            raise DataError(f"dataset directory not found: {root}")
        manifest = Manifest.load(root)
        tokenizer = root / manifest.tokenizer_file
        if not tokenizer.is_file():
            raise DataError(f"dataset {root} has no {manifest.tokenizer_file}")
        if file_sha256(tokenizer) != manifest.tokenizer_sha256:
            raise DataError(
                f"{tokenizer} does not match the manifest (sha256 differs): dataset and tokenizer mixed"
            )
        train = [_open_shard(root, info, manifest, verify) for info in manifest.train]
        val = _open_shard(root, manifest.val, manifest, verify)
        return cls(root, manifest, train, val)

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    @property
    def train_tokens(self) -> int:
        return self.manifest.train_tokens

    @property
    def val_tokens(self) -> int:
        return self.manifest.val_tokens

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest.dtype)

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest.tokenizer_sha256

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / self.manifest.tokenizer_file

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.data_dir)!r}, train_tokens={self.train_tokens}, "
            f"val_tokens={self.val_tokens}, vocab_size={self.vocab_size}, shards={len(self.train_shards)})"
        )


def _open_shard(root: Path, info: ShardInfo, manifest: Manifest, verify: bool) -> np.ndarray:
    path = root / info.file
    name = info.file
    if not path.is_file():
        raise DataError(f"shard {name} is missing from {root}")
    expected_dtype = np.dtype(manifest.dtype).newbyteorder("<")
    # Parse the header ourselves first: np.load on a damaged file raises a variety of
    # exceptions with messages that do not say which file or what is wrong.
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            data_offset = handle.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as exc:
        raise DataError(f"shard {name} is corrupt: not a valid .npy file ({exc})") from exc
    if len(shape) != 1 or fortran_order:
        raise DataError(f"shard {name} is corrupt: expected a 1-D token array, found shape {shape}")
    if dtype != expected_dtype:
        raise DataError(f"shard {name} is corrupt: expected dtype {manifest.dtype}, found {dtype}")
    if shape[0] != info.tokens:
        raise DataError(f"shard {name} is corrupt: expected {info.tokens} tokens, header says {shape[0]}")
    size = path.stat().st_size
    found = (size - data_offset) // dtype.itemsize
    if size - data_offset != info.tokens * dtype.itemsize:
        raise DataError(
            f"shard {name} is corrupt: expected {info.tokens} tokens, found {found} (file truncated?)"
        )
    if size != info.bytes:
        raise DataError(f"shard {name} is corrupt: expected {info.bytes} bytes, found {size}")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"shard {name} is corrupt: {exc}") from exc
    if verify and file_sha256(path) != info.sha256:
        raise DataError(f"shard {name} is corrupt: sha256 does not match the manifest")
    for sample in (tokens[:_ID_CHECK_TOKENS], tokens[-_ID_CHECK_TOKENS:]):
        if sample.size and int(sample.max()) >= manifest.vocab_size:
            raise DataError(
                f"shard {name} is corrupt: token id {int(sample.max())} >= vocab size {manifest.vocab_size}"
            )
    return tokens
