"""``swarm-data``: command-line front end of the data layer.

Examples::

    swarm-data train-tokenizer --input 'corpus/*.jsonl' --vocab-size 32000 --out tokenizer.json
    swarm-data prepare --input 'corpus/*.jsonl' --tokenizer tokenizer.json --out data/corpus
    swarm-data stdlib --out data/stdlib --vocab-size 4096
    swarm-data inspect data/corpus --verify

Bad input prints ``error: <one line>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from swarm.data.dataset import TokenDataset
from swarm.data.errors import DataError
from swarm.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from swarm.data.stdlib_corpus import build_stdlib_dataset, ensure_stdlib_dataset
from swarm.data.tokenizer import train_bpe_tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status (0 ok, 2 bad input, 1 system error)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args.handler(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permission denied, ...: not the input's fault
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _train_tokenizer(args: argparse.Namespace) -> int:
    out = train_bpe_tokenizer(
        args.input, args.vocab_size, args.out, min_frequency=args.min_frequency, text_field=args.text_field
    )
    print(f"wrote {out}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    manifest = prepare(
        args.input,
        args.tokenizer,
        args.out,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        num_workers=args.workers,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    print(
        f"wrote {args.out}: {manifest.train_tokens:,} train tokens in {len(manifest.train)} shard(s), "
        f"{manifest.val_tokens:,} val tokens"
    )
    return 0


def _stdlib(args: argparse.Namespace) -> int:
    if args.out is not None:
        out = build_stdlib_dataset(
            args.out, vocab_size=args.vocab_size, num_workers=args.workers, progress=not args.quiet
        )
    else:
        out = ensure_stdlib_dataset(
            args.cache_dir, vocab_size=args.vocab_size, num_workers=args.workers, progress=not args.quiet
        )
    print(out)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    dataset = TokenDataset.open(args.dir, verify=args.verify)
    manifest = dataset.manifest
    source_bytes = sum(source.bytes for source in manifest.sources)
    rows = [
        ("dataset", str(dataset.data_dir)),
        ("tokenizer", f"{manifest.tokenizer_file} (sha256 {manifest.tokenizer_sha256[:16]}...)"),
        ("vocab size", f"{manifest.vocab_size:,} (eos id {manifest.eos_id}, dtype {manifest.dtype})"),
        (
            "train",
            f"{manifest.train_tokens:,} tokens in {len(manifest.train)} shard(s), "
            f"{manifest.train_documents:,} documents",
        ),
        ("val", f"{manifest.val_tokens:,} tokens, {manifest.val_documents:,} documents"),
        (
            "sources",
            f"{len(manifest.sources)} file(s), {source_bytes / 1e6:.1f} MB, field {manifest.text_field!r}",
        ),
        (
            "shards",
            "sha256 verified" if args.verify else "header, size and ids checked (--verify for sha256)",
        ),
    ]
    for label, value in rows:
        print(f"{label:<11} {value}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-data", description="Tokenize corpora into swarm datasets.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer")
    train.add_argument("--input", "-i", action="append", required=True, help="file, directory or glob")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", type=Path, required=True, help="tokenizer.json to write")
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--text-field", default="text", help="JSONL field / parquet column")
    train.set_defaults(handler=_train_tokenizer)

    prep = commands.add_parser("prepare", help="tokenize inputs into .npy shards + manifest.json")
    prep.add_argument("--input", "-i", action="append", required=True, help="file, directory or glob")
    prep.add_argument("--tokenizer", required=True, help="tokenizer.json (or a directory holding one)")
    prep.add_argument("--out", type=Path, required=True, help="dataset directory to create")
    prep.add_argument("--text-field", default="text", help="JSONL field / parquet column")
    prep.add_argument("--val-fraction", type=float, default=0.01)
    prep.add_argument("--workers", type=int, default=None, help="tokenizer processes (default min(4, CPUs))")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    prep.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    prep.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    prep.set_defaults(handler=_prepare)

    stdlib = commands.add_parser("stdlib", help="build the embedded Python-stdlib corpus")
    where = stdlib.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help="build into this directory")
    where.add_argument(
        "--cache-dir", type=Path, default=None, help="cache root ($SWARM_CACHE, ~/.cache/swarm)"
    )
    stdlib.add_argument("--vocab-size", type=int, default=4096)
    stdlib.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    stdlib.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    stdlib.set_defaults(handler=_stdlib)

    inspect = commands.add_parser("inspect", help="validate a dataset and print its summary")
    inspect.add_argument("dir", type=Path)
    inspect.add_argument("--verify", action="store_true", help="also check the sha256 of every shard")
    inspect.set_defaults(handler=_inspect)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
