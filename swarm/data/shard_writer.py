"""Streaming token ids into flat ``.npy`` shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from swarm.data.manifest import ShardInfo, file_sha256


class ShardWriter:
    """Cut a stream of token id arrays into ``.npy`` files of ``shard_tokens`` tokens each.

    Usage::

        writer = ShardWriter(out_dir, "train", np.uint16, shard_tokens=1 << 26)
        for ids in documents:
            writer.write(ids)
        shards = writer.close()       # [ShardInfo(file="train_00000.npy", ...), ...]

    With ``shard_tokens=None`` everything goes into a single file named ``<prefix>.npy``
    (used for the validation split). Files are real ``.npy`` arrays, readable with
    ``np.load(path, mmap_mode="r")``. Documents are split across shard boundaries: the
    sampler draws windows within a shard, and the EOS ids still mark document ends.
    """

    def __init__(
        self, directory: Path, prefix: str, dtype: type[np.unsignedinteger], shard_tokens: int | None
    ):
        if shard_tokens is not None and shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.directory = directory
        self.prefix = prefix
        self.dtype = np.dtype(dtype).newbyteorder("<")  # explicit: shards move between machines
        self.shard_tokens = shard_tokens
        self.shards: list[ShardInfo] = []
        # One growable buffer rather than a list of per-document arrays: millions of tiny
        # documents would otherwise cost ~100 bytes of object overhead each.
        self._buffer = np.empty(1 << 16, dtype=self.dtype)
        self._pending_tokens = 0

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        while ids.size:
            room = ids.size if self.shard_tokens is None else self.shard_tokens - self._pending_tokens
            head, ids = ids[:room], ids[room:]
            end = self._pending_tokens + head.size
            if end > self._buffer.size:
                size = max(end, 2 * self._buffer.size)
                if self.shard_tokens is not None:
                    size = min(size, self.shard_tokens)  # end <= shard_tokens: `room` bounds it
                grown = np.empty(size, dtype=self.dtype)
                grown[: self._pending_tokens] = self._buffer[: self._pending_tokens]
                self._buffer = grown
            self._buffer[self._pending_tokens : end] = head
            self._pending_tokens = end
            if self.shard_tokens is not None and self._pending_tokens == self.shard_tokens:
                self._flush()

    def close(self) -> list[ShardInfo]:
        # A single-file writer always produces its file, even if empty, so the dataset layout
        # is fixed; a sharded writer only writes a final partial shard if it has tokens.
        if self._pending_tokens or (self.shard_tokens is None and not self.shards):
            self._flush()
        return self.shards

    def _flush(self) -> None:
        if self.shard_tokens is None:
            name = f"{self.prefix}.npy"
        else:
            name = f"{self.prefix}_{len(self.shards):05d}.npy"
        path = self.directory / name
        count = self._pending_tokens
        array = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=(count,))
        array[:] = self._buffer[:count]
        array.flush()
        del array  # closes the memory map before the file is hashed
        self.shards.append(
            ShardInfo(file=name, tokens=count, bytes=path.stat().st_size, sha256=file_sha256(path))
        )
        self._pending_tokens = 0
