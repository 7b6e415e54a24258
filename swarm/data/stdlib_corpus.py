"""The embedded default corpus: this Python's own standard library sources, no download needed."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from swarm.data.manifest import MANIFEST_NAME
from swarm.data.prepare import prepare
from swarm.data.tokenizer import train_bpe_tokenizer

log = logging.getLogger(__name__)

# Bump when the file selection or build recipe changes, so old caches are not reused.
CORPUS_VERSION = 1
# Left out: installed third-party packages (not the stdlib, and machine-dependent), the test
# suites (half the size, much of it generated or deliberately odd code), and `encodings`
# (1.4 MB of codec lookup tables that would teach the model little). What remains is about
# 600 files / 10.7 MB on CPython 3.11.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
)


def default_cache_dir() -> Path:
    """``$SWARM_CACHE`` if set, else ``~/.cache/swarm``."""
    env = os.environ.get("SWARM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swarm"


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The corpus files: the standard library's ``.py`` files, sorted, optionally only the first few.

    Files that are not valid UTF-8 are skipped (none are on CPython 3.11, but a patched
    distribution could ship one, and the corpus must never fail to build because of it).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        # Sorting in place makes os.walk itself deterministic; "config-3.x-..." holds build files.
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in sorted(names):
            if name.endswith(".py"):
                path = Path(directory) / name
                try:
                    path.read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                files.append(path)
    return files[:max_files] if max_files is not None else files


def ensure_stdlib_dataset(
    cache_dir: str | Path | None = None,
    vocab_size: int = 4096,
    progress: bool = True,
    max_files: int | None = None,
    val_fraction: float = 0.01,
    num_workers: int | None = 1,
) -> Path:
    """Return a prepared dataset of the stdlib sources, building it on first use.

    The result directory (``tokenizer.json``, shards, ``manifest.json``) lives under
    ``cache_dir`` (default ``default_cache_dir()``) keyed by Python version, file list, vocab
    size and split, and is reused afterwards. Concurrent callers, e.g. several peers started
    at once on one machine, serialise on a lock file: one builds, the others wait and reuse.
    ``max_files`` limits the corpus (for tests). Takes a few seconds on two cores.

    ``num_workers`` defaults to 1 (tokenize in this process): for a corpus this small the
    tokenizer's own threads beat a process pool, whose start-up costs more than it saves
    (measured 3.3 s vs 6.0 s on two cores), and a trainer calling this needs no main guard.
    """
    files = stdlib_files(max_files)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / _cache_key(files, vocab_size, val_fraction)
    if (target / MANIFEST_NAME).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, even on a crash
        # Someone else may have finished the build while we waited for the lock.
        if (target / MANIFEST_NAME).is_file():
            return target
        log.info("building stdlib dataset %s from %d files", target, len(files))
        build_stdlib_dataset(
            target,
            files,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            progress=progress,
        )
    return target


def build_stdlib_dataset(
    out_dir: str | Path,
    files: list[Path] | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.01,
    num_workers: int | None = 1,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Build the stdlib dataset into ``out_dir`` unconditionally (no cache, no lock)."""
    out = Path(out_dir)
    files = stdlib_files() if files is None else files
    started = time.monotonic()
    work = out.parent / f".{out.name}.build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        tokenizer = train_bpe_tokenizer(files, vocab_size, work / "tokenizer.json")
        # prepare() assembles the dataset under a temporary name and renames it into place,
        # so `out` only ever appears complete, even if this process is killed.
        prepare(
            files,
            tokenizer,
            out,
            val_fraction=val_fraction,
            num_workers=num_workers,
            progress=progress,
            overwrite=overwrite,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("built stdlib dataset %s in %.1f s", out, time.monotonic() - started)
    return out


def _cache_key(files: list[Path], vocab_size: int, val_fraction: float) -> str:
    digest = hashlib.sha256()
    digest.update(f"{CORPUS_VERSION}|{sys.version}|{vocab_size}|{val_fraction}\n".encode())
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in files:
        # Contents, not just names: a patched stdlib must not reuse a stale dataset, and
        # hashing 11 MB costs about 15 ms.
        data = path.read_bytes()
        digest.update(f"{path.relative_to(root)}:{len(data)}\n".encode())
        digest.update(data)
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    return f"stdlib-py{version}-v{vocab_size}-{digest.hexdigest()[:12]}"
