"""``prepare``: turn text files into tokenized ``.npy`` shards plus a ``manifest.json``."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from swarm.data.errors import DataError
from swarm.data.manifest import MANIFEST_NAME, Manifest, SourceInfo, file_sha256
from swarm.data.parallel_encode import default_num_workers, encode_documents
from swarm.data.shard_writer import ShardWriter
from swarm.data.sources import expand_inputs, iter_documents
from swarm.data.tokenizer import eos_id, load_tokenizer, resolve_tokenizer_path, vocab_size

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens = 128 MiB per uint16 shard
TOKENIZER_NAME = "tokenizer.json"


@dataclass
class _Scan:
    sources: list[SourceInfo]
    sizes: np.ndarray  # utf-8 bytes per document
    digests: np.ndarray  # 64-bit content hash per document


def prepare(
    inputs: Sequence[str | Path],
    tokenizer_path: str | Path,
    out_dir: str | Path,
    text_field: str = "text",
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    num_workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Manifest:
    """Tokenize ``inputs`` (paths, directories or globs) into a dataset directory ``out_dir``.

    Every document gets the tokenizer's EOS id appended. Whole documents are held out for
    validation (``val.npy``), chosen by content hash until ``val_fraction`` of the bytes is
    reached, so the split is stable and independent of file order and worker count; the rest
    goes to ``train_00000.npy``, ... of ``shard_tokens`` tokens each. The tokenizer is copied
    into the directory, which is assembled under a temporary name and renamed into place at the
    end: an interrupted run never leaves a directory that looks complete. Same inputs and
    tokenizer give byte-identical shards for any ``num_workers``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"shard tokens must be positive, got {shard_tokens}")
    files = expand_inputs(inputs)
    tokenizer_file = resolve_tokenizer_path(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_file)
    eos = eos_id(tokenizer)
    vocab = vocab_size(tokenizer)
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    workers = default_num_workers() if num_workers is None else max(1, num_workers)

    scan = _scan(files, text_field, progress)
    is_val = select_validation(scan.sizes, scan.digests, val_fraction)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        shutil.copyfile(tokenizer_file, tmp / TOKENIZER_NAME)
        train = ShardWriter(tmp, "train", dtype, shard_tokens)
        val = ShardWriter(tmp, "val", dtype, None)
        bar = tqdm(
            total=int(scan.sizes.sum()), unit="B", unit_scale=True, desc="tokenizing", disable=not progress
        )
        with bar:
            documents = _documents(files, text_field, scan.sources)
            for index, ids in enumerate(encode_documents(documents, tokenizer_file, eos, workers)):
                (val if is_val[index] else train).write(ids)
                bar.update(int(scan.sizes[index]))
        # select_validation always leaves a training document, so train_shards is never empty.
        train_shards, val_shards = train.close(), val.close()
        manifest = Manifest(
            dtype=np.dtype(dtype).name,
            vocab_size=vocab,
            eos_id=eos,
            tokenizer_file=TOKENIZER_NAME,
            tokenizer_sha256=file_sha256(tmp / TOKENIZER_NAME),
            train=tuple(train_shards),
            val=val_shards[0],
            train_documents=int((~is_val).sum()),
            val_documents=int(is_val.sum()),
            text_field=text_field,
            val_fraction=val_fraction,
            sources=tuple(scan.sources),
        )
        manifest.save(tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def select_validation(sizes: np.ndarray, digests: np.ndarray, val_fraction: float) -> np.ndarray:
    """Boolean mask of validation documents: lowest content hashes first, until the byte budget.

    At least one document is held out when ``val_fraction > 0`` (tiny corpora still get a
    validation set) and at least one is always left for training.
    """
    count = len(sizes)
    is_val = np.zeros(count, dtype=bool)
    if val_fraction <= 0 or count == 0:
        return is_val
    if count < 2:
        raise DataError(
            "only one input document: cannot hold one out for validation (use val_fraction=0, --val-fraction 0)"
        )
    order = np.lexsort((np.arange(count), digests))  # by hash; position breaks exact-duplicate ties
    taken_before = np.cumsum(sizes[order]) - sizes[order]
    chosen = order[taken_before < val_fraction * sizes.sum()][: count - 1]
    is_val[chosen] = True
    return is_val


def _scan(files: list[Path], text_field: str, progress: bool) -> _Scan:
    """First pass: count and hash documents (cheap next to tokenizing) to fix the split up front."""
    sources: list[SourceInfo] = []
    sizes = array("q")
    digests = array("Q")
    for path in tqdm(files, desc="scanning", unit="file", disable=not progress or len(files) < 2):
        documents = 0
        for text in iter_documents(path, text_field):
            data = text.encode("utf-8")
            sizes.append(len(data))
            digests.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))
            documents += 1
        sources.append(SourceInfo(path=str(path), bytes=path.stat().st_size, documents=documents))
    if not sizes:
        raise DataError(f"no non-empty documents in the {len(files)} input file(s), e.g. {files[0]}")
    return _Scan(sources, np.asarray(sizes, dtype=np.int64), np.asarray(digests, dtype=np.uint64))


def _documents(files: list[Path], text_field: str, sources: list[SourceInfo]) -> Iterator[str]:
    """Second pass over the inputs; the document counts must match the first pass."""
    for path, source in zip(files, sources, strict=True):
        documents = 0
        for text in iter_documents(path, text_field):
            documents += 1
            if documents > source.documents:
                break
            yield text
        if documents != source.documents:
            raise DataError(f"input file {path} changed while it was being prepared")


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output path {out} exists and is not a directory")
    if any(out.iterdir()):
        if not (out / MANIFEST_NAME).exists():
            raise DataError(f"output directory {out} is not empty and is not a prepared dataset")
        if not overwrite:
            raise DataError(f"output directory {out} already holds a dataset (use --overwrite to replace it)")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished directory into place, replacing an existing dataset or empty directory."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
