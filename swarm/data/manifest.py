"""``manifest.json``: the description of a prepared dataset directory, with strict validation."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from swarm.data.errors import DataError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "swarm-tokens"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class ShardInfo:
    """One ``.npy`` token shard: its file name (relative to the dataset dir), length and checksum."""

    file: str
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SourceInfo:
    """One input file that went into the dataset."""

    path: str
    bytes: int
    documents: int


@dataclass(frozen=True)
class Manifest:
    """What ``prepare`` wrote; ``TokenDataset`` checks the shards against it.

    Usage::

        manifest = Manifest.load(data_dir)        # DataError if missing or malformed
        manifest.train_tokens, manifest.dtype, manifest.eos_id
        manifest.save(other_dir)                  # atomic write
    """

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_file: str
    tokenizer_sha256: str
    train: tuple[ShardInfo, ...]
    val: ShardInfo
    train_documents: int
    val_documents: int
    text_field: str
    val_fraction: float
    sources: tuple[SourceInfo, ...]

    @property
    def train_tokens(self) -> int:
        return sum(shard.tokens for shard in self.train)

    @property
    def val_tokens(self) -> int:
        return self.val.tokens

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["train"] = [asdict(s) for s in self.train]
        body["sources"] = [asdict(s) for s in self.sources]
        # Totals are redundant but make the file readable without summing by hand.
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "train_tokens": self.train_tokens,
            "val_tokens": self.val_tokens,
            **body,
        }

    def save(self, data_dir: str | Path) -> Path:
        path = Path(data_dir) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, data_dir: str | Path) -> Manifest:
        path = Path(data_dir) / MANIFEST_NAME
        if not path.is_file():
            raise DataError(
                f"no {MANIFEST_NAME} in {data_dir} (not a prepared dataset; run `swarm-data prepare`)"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(raw, dict):
            raise DataError(f"{where}: expected a JSON object")
        if raw.get("format") != FORMAT_NAME:
            raise DataError(f"{where}: not a swarm dataset manifest (format={raw.get('format')!r})")
        if raw.get("version") != FORMAT_VERSION:
            raise DataError(
                f"{where}: unsupported manifest version {raw.get('version')!r} (expected {FORMAT_VERSION})"
            )
        dtype = _field(raw, "dtype", str, where)
        if dtype not in DTYPES:
            raise DataError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        train_raw = _field(raw, "train", list, where)
        manifest = cls(
            dtype=dtype,
            vocab_size=_field(raw, "vocab_size", int, where),
            eos_id=_field(raw, "eos_id", int, where),
            tokenizer_file=_field(raw, "tokenizer_file", str, where),
            tokenizer_sha256=_field(raw, "tokenizer_sha256", str, where),
            train=tuple(_shard(s, f"{where}: train[{i}]") for i, s in enumerate(train_raw)),
            val=_shard(_field(raw, "val", dict, where), f"{where}: val"),
            train_documents=_field(raw, "train_documents", int, where),
            val_documents=_field(raw, "val_documents", int, where),
            text_field=_field(raw, "text_field", str, where),
            val_fraction=float(_field(raw, "val_fraction", (int, float), where)),
            sources=tuple(_source(s, f"{where}: sources") for s in _field(raw, "sources", list, where)),
        )
        if not 0 <= manifest.eos_id < manifest.vocab_size:
            raise DataError(
                f"{where}: eos_id {manifest.eos_id} is outside the vocabulary ({manifest.vocab_size})"
            )
        return manifest


def file_sha256(path: str | Path) -> str:
    """Return the hex sha256 of a file's bytes (streamed, so shards of any size are fine)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _field(raw: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in raw:
        raise DataError(f"{where}: missing field {key!r}")
    value = raw[key]
    # bool is an int subclass; a manifest saying `"tokens": true` is corrupt, not 1.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DataError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _shard(raw: Any, where: str) -> ShardInfo:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object")
    shard = ShardInfo(
        file=_field(raw, "file", str, where),
        tokens=_field(raw, "tokens", int, where),
        bytes=_field(raw, "bytes", int, where),
        sha256=_field(raw, "sha256", str, where),
    )
    # Shard names come from a file someone could edit; never let them point outside the dataset.
    if Path(shard.file).name != shard.file or not shard.file.endswith(".npy"):
        raise DataError(f"{where}: shard file {shard.file!r} must be a plain .npy file name")
    if shard.tokens < 0 or shard.bytes < 0:
        raise DataError(f"{where}: negative size for {shard.file}")
    return shard


def _source(raw: Any, where: str) -> SourceInfo:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object")
    return SourceInfo(
        path=_field(raw, "path", str, where),
        bytes=_field(raw, "bytes", int, where),
        documents=_field(raw, "documents", int, where),
    )
