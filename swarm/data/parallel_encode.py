"""Order-preserving, multi-process tokenization of a stream of documents."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from swarm.data.tokenizer import load_tokenizer

# Documents are sent to workers in chunks of about this many characters: large enough that
# inter-process overhead is negligible, small enough that memory stays bounded.
CHUNK_CHARS = 1 << 20
CHUNK_DOCS = 1024

_worker_tokenizer: Tokenizer | None = None


def default_num_workers() -> int:
    """min(4, usable CPUs): tokenization scales well up to a few processes, then I/O dominates."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not available on macOS
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def encode_documents(
    documents: Iterable[str], tokenizer_file: Path, eos_id: int, num_workers: int
) -> Iterator[np.ndarray]:
    """Yield one uint32 id array per document (EOS appended), in the order of ``documents``.

    The ids of a document depend only on its text, never on chunking or the number of
    workers, which is what makes ``prepare`` byte-for-byte deterministic. With
    ``num_workers == 1`` everything runs in this process (no start-up cost, which is what
    small corpora and tests want; tokenizers still uses its own threads there); otherwise a
    pool of ``num_workers`` spawned processes is used, which like any "spawn" pool requires
    the calling script to guard its entry point with ``if __name__ == "__main__":``.
    """
    chunks = _chunked(documents)
    if num_workers <= 1:
        tokenizer = _load_for_documents(tokenizer_file)
        for chunk in chunks:
            yield from _split(*_encode_chunk(tokenizer, chunk, eos_id))
        return

    # "spawn" rather than fork: the caller may be a trainer with live torch/rayon threads,
    # and forking a multi-threaded process can deadlock the child.
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(num_workers, initializer=_init_worker, initargs=(str(tokenizer_file),))
    try:
        # Bounded look-ahead instead of Pool.imap: imap drains the input iterator eagerly
        # and would read a whole corpus into memory. Consuming results first-in-first-out
        # keeps the output order equal to the input order.
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk, eos_id)))
            if len(pending) >= 2 * num_workers:
                yield from _split(*pending.popleft().get())
        while pending:
            yield from _split(*pending.popleft().get())
    finally:
        pool.terminate()
        pool.join()


def _chunked(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in documents:
        chunk.append(text)
        chars += len(text)
        if chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode texts into (lengths, concatenated ids); lengths include the appended EOS."""
    # No special tokens from the tokenizer's post-processor (e.g. a Llama BOS): documents are
    # delimited by the EOS we append ourselves, the same way for every tokenizer.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    ids = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for encoding, length in zip(encodings, lengths, strict=True):
        ids[pos : pos + length - 1] = encoding.ids
        ids[pos + length - 1] = eos_id
        pos += length
    return lengths, ids


def _split(lengths: np.ndarray, ids: np.ndarray) -> Iterator[np.ndarray]:
    start = 0
    for length in lengths.tolist():
        yield ids[start : start + length]
        start += length


def _init_worker(tokenizer_file: str) -> None:
    # One process per core already; rayon threads inside each worker would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _worker_tokenizer
    _worker_tokenizer = _load_for_documents(Path(tokenizer_file))


def _load_for_documents(tokenizer_file: Path) -> Tokenizer:
    tokenizer = load_tokenizer(tokenizer_file)
    # A document that literally contains "<|endoftext|>" (e.g. text about tokenizers) must
    # not produce a fake document boundary: encode special tokens in the input as plain text.
    if hasattr(tokenizer, "encode_special_tokens"):
        tokenizer.encode_special_tokens = True
    return tokenizer


def _encode_in_worker(texts: list[str], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "worker used without _init_worker"
    return _encode_chunk(_worker_tokenizer, texts, eos_id)
