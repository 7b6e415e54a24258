"""Shared fixtures of the data-layer tests: a small mixed corpus with its tokenizer, and a dataset prepared
from it. Registered for every test module by ``pytest_plugins`` in conftest.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swarm.data import prepare, train_bpe_tokenizer

WORDS = (
    "the swarm trains a mixture of experts model across peers that share gradients and "
    "parameters over the network while each peer samples its own batches from shards"
).split()


def _make_docs(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(20, 120)))
        docs.append(" ".join(words) + f"\n{int(rng.integers(0, 10**6))} ünïcödé ✓\n")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three .txt files, a .jsonl(.gz) and a .parquet file, plus a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _make_docs(60)
    for i, text in enumerate(docs[:3]):
        (root / f"doc{i}.txt").write_text(text, encoding="utf-8")
    with open(root / "part.jsonl", "w", encoding="utf-8") as handle:
        for text in docs[3:30]:
            handle.write(json.dumps({"id": 1, "text": text}) + "\n")
        handle.write("\n")  # blank lines are ignored
    with gzip.open(root / "more.jsonl.gz", "wt", encoding="utf-8") as handle:
        for text in docs[30:40]:
            handle.write(json.dumps({"text": text}) + "\n")
    pq.write_table(pa.table({"text": docs[40:], "n": list(range(20))}), root / "part.parquet")
    tokenizer = train_bpe_tokenizer(
        [str(root / "*")], vocab_size=400, out_path=root / "tok" / "tokenizer.json"
    )
    return {"root": root, "docs": docs, "tokenizer": tokenizer}


@pytest.fixture()
def prepared(corpus: dict, tmp_path: Path) -> Path:
    out = tmp_path / "data"
    prepare(
        [corpus["root"]],
        corpus["tokenizer"],
        out,
        val_fraction=0.2,
        shard_tokens=1500,
        num_workers=1,
        progress=False,
    )
    return out
