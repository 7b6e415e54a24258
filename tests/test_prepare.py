"""prepare (swarm.data.prepare): mixed inputs to shards, determinism, input errors, overwrite, dtypes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from swarm.data import DataError, TokenDataset, load_tokenizer, prepare
from swarm.data.tokenizer import eos_id


def _expected_ids(tokenizer_path: Path, docs: list[str]) -> list[list[int]]:
    tok = load_tokenizer(tokenizer_path)
    eos = eos_id(tok)
    return [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]


def _split_docs(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(tokens[s : e + 1].tolist()) for s, e in zip(starts, ends, strict=True)]


def test_prepare_mixed_inputs_token_counts_and_npy_format(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "data"
    manifest = prepare(
        [str(corpus["root"] / "*")],
        corpus["tokenizer"],
        out,
        val_fraction=0.1,
        shard_tokens=1000,
        num_workers=1,
        progress=False,
    )
    expected = _expected_ids(corpus["tokenizer"], corpus["docs"])
    assert manifest.train_tokens + manifest.val_tokens == sum(len(ids) for ids in expected)
    assert manifest.train_documents + manifest.val_documents == len(corpus["docs"])
    assert manifest.val_documents >= 1 and manifest.dtype == "uint16" and len(manifest.train) > 1
    train = [np.load(out / s.file, mmap_mode="r") for s in manifest.train]
    assert all(a.ndim == 1 and a.dtype == np.uint16 for a in train)
    assert all(len(a) == 1000 for a in train[:-1])
    val = np.load(out / "val.npy", mmap_mode="r")
    # Every document appears exactly once, in train or val, with its EOS.
    found = _split_docs(np.concatenate(train), 0) + _split_docs(np.asarray(val), 0)
    assert sorted(found) == sorted(tuple(ids) for ids in expected)
    assert (out / "tokenizer.json").read_bytes() == corpus["tokenizer"].read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_prepare_is_deterministic_across_worker_counts(corpus: dict, tmp_path: Path) -> None:
    dirs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(
            [corpus["root"]], corpus["tokenizer"], out, shard_tokens=700, num_workers=workers, progress=False
        )
        dirs.append(out)
    names = sorted(p.name for p in dirs[0].iterdir())
    assert names == sorted(p.name for p in dirs[1].iterdir())
    for name in names:
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name


def test_literal_special_token_in_text_is_not_a_document_boundary(corpus: dict, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("see <|endoftext|> here")
    (tmp_path / "b.txt").write_text("second document")
    manifest = prepare(
        [tmp_path / "*.txt"], corpus["tokenizer"], tmp_path / "d", num_workers=1, progress=False
    )
    assert manifest.train_documents + manifest.val_documents == 2
    dataset = TokenDataset.open(tmp_path / "d")
    tokens = np.concatenate([dataset.train_shards[0], dataset.val])
    assert int((tokens == 0).sum()) == 2


def test_jsonl_lone_surrogate_is_replaced_not_fatal(corpus: dict, tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_text('{"text": "a \\ud800 b \\ud83d\\ude00"}\n{"text": "c"}\n')
    prepare([tmp_path / "s.jsonl"], corpus["tokenizer"], tmp_path / "d", val_fraction=0, progress=False)
    dataset = TokenDataset.open(tmp_path / "d")
    text = load_tokenizer(dataset.tokenizer_path).decode(dataset.train_shards[0].tolist())
    assert text == "a \ufffd\ufffd\ufffd b \U0001f600c"


def test_prepare_input_errors(corpus: dict, tmp_path: Path) -> None:
    tok = corpus["tokenizer"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text here"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no field 'text' \(fields: body\)"):
        prepare([bad], tok, tmp_path / "o1", progress=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"broken.jsonl:2: invalid JSON"):
        prepare([broken], tok, tmp_path / "o2", progress=False)
    with pytest.raises(DataError, match=r"part.parquet: no column 'body'"):
        prepare([corpus["root"] / "part.parquet"], tok, tmp_path / "o3", text_field="body", progress=False)
    with pytest.raises(DataError, match="tokenizer file not found"):
        prepare([corpus["root"]], tmp_path / "nope.json", tmp_path / "o4", progress=False)
    with pytest.raises(DataError, match="no input files match"):
        prepare([str(tmp_path / "*.txt")], tok, tmp_path / "o5", progress=False)
    assert not (tmp_path / "o1").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prepare_refuses_to_clobber_without_overwrite(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "data"
    prepare([corpus["root"] / "*.txt"], corpus["tokenizer"], out, num_workers=1, progress=False)
    with pytest.raises(DataError, match="already holds a dataset"):
        prepare([corpus["root"] / "*.txt"], corpus["tokenizer"], out, num_workers=1, progress=False)
    prepare(
        [corpus["root"] / "*.txt"], corpus["tokenizer"], out, num_workers=1, progress=False, overwrite=True
    )
    TokenDataset.open(out)


def test_large_vocab_uses_uint32(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i + 2 for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w69999 w5 w70000")
    (tmp_path / "b.txt").write_text("w1")
    prepare([tmp_path / "*.txt"], tmp_path / "tokenizer.json", tmp_path / "d", val_fraction=0, progress=False)
    dataset = TokenDataset.open(tmp_path / "d")
    assert dataset.dtype == np.uint32 and dataset.eos_id == 1 and dataset.vocab_size == 70_002
    assert dataset.train_shards[0].tolist() == [70_001, 7, 0, 1, 3, 1]  # w70000 is <unk>
