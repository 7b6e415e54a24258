"""Input files: expanding globs and reading documents out of .txt, .jsonl and .parquet files."""

from __future__ import annotations

import glob
import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from swarm.data.errors import DataError

# Plain-text files are one document each; .py and .md are included so that source trees
# (such as the embedded standard-library corpus) can be fed in directly.
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py", ".txt.gz", ".md.gz", ".py.gz")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def file_kind(path: Path) -> str:
    """Return ``"text"``, ``"jsonl"`` or ``"parquet"`` for a supported file name, else raise DataError."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    raise DataError(f"unsupported input file type: {path} (expected one of {', '.join(SUPPORTED_SUFFIXES)})")


def expand_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand paths, directories (searched recursively) and glob patterns into a sorted file list.

    The result is sorted and de-duplicated so that the document order, and therefore the
    prepared shards, do not depend on how the user spelled or ordered the inputs.
    """
    if not inputs:
        raise DataError("no input files given")
    found: set[Path] = set()
    for item in inputs:
        text = str(item)
        if glob.has_magic(text):
            matches = [Path(m) for m in glob.glob(text, recursive=True) if Path(m).is_file()]
            if not matches:
                raise DataError(f"no input files match {text!r}")
        else:
            path = Path(text)
            if path.is_dir():
                matches = [
                    p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(SUPPORTED_SUFFIXES)
                ]
                if not matches:
                    raise DataError(f"no supported input files in directory {path}")
            elif path.is_file():
                matches = [path]
            else:
                raise DataError(f"input file not found: {path}")
        for match in matches:
            file_kind(match)  # reject unsupported types before any work is done
            found.add(match.resolve())
    return sorted(found)


def iter_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of one input file, raising DataError on unreadable content.

    ``.txt``-like files are one document; ``.jsonl`` has one JSON object per line with the text
    under ``text_field``; ``.parquet`` has a string column ``text_field``. Null or empty texts
    are skipped, a missing field is an error (it almost always means the wrong ``--text-field``).
    """
    kind = file_kind(path)
    try:
        if kind == "text":
            yield from _read_text(path)
        elif kind == "jsonl":
            yield from _read_jsonl(path, text_field)
        else:
            yield from _read_parquet(path, text_field)
    except DataError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _read_text(path: Path) -> Iterator[str]:
    with _open_binary(path) as handle:
        raw = handle.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not valid UTF-8 (byte {exc.start})") from exc
    if text:
        yield text


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with _open_binary(path) as handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: line is not valid UTF-8") from exc
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if text_field not in record:
                fields = ", ".join(sorted(record)[:10]) or "none"
                raise DataError(f"{path}:{lineno}: no field {text_field!r} (fields: {fields})")
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, expected a string"
                )
            if b"\\ud" in raw or b"\\uD" in raw:
                # JSON can escape lone UTF-16 surrogates, which no tokenizer accepts; replace
                # them with U+FFFD like any other undecodable text (valid pairs are joined
                # by the JSON decoder already).
                text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            if text:
                yield text


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    # Imported lazily: pyarrow is heavy and only needed for parquet inputs.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names[:10]) or 'none'})")
        column_type = parquet.schema_arrow.field(text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise DataError(f"{path}: column {text_field!r} has type {column_type}, expected a string")
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text
    except pa.ArrowException as exc:
        raise DataError(f"cannot read parquet file {path}: {exc}") from exc
