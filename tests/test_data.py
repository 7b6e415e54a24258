"""Tests of the data layer (swarm.data): tokenizer, prepare, dataset validation, sampling, CLI."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from swarm.data import (
    DataError,
    TokenDataset,
    WindowSampler,
    load_tokenizer,
    prepare,
    train_bpe_tokenizer,
    validation_batches,
)
from swarm.data.cli import main as cli_main
from swarm.data.stdlib_corpus import stdlib_files
from swarm.data.tokenizer import eos_id

REPO_ROOT = Path(__file__).resolve().parents[1]

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


def _expected_ids(tokenizer_path: Path, docs: list[str]) -> list[list[int]]:
    tok = load_tokenizer(tokenizer_path)
    eos = eos_id(tok)
    return [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]


def _split_docs(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(tokens[s : e + 1].tolist()) for s, e in zip(starts, ends, strict=True)]


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_trains_loads_in_transformers_and_round_trips(corpus: dict, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    path = corpus["tokenizer"]
    tok = load_tokenizer(path)
    assert tok.token_to_id("<|endoftext|>") == 0 == eos_id(tok)
    assert tok.get_vocab_size() <= 400
    text = "def f(x):\n    return x  # ünïcödé ✓ \t\n"
    assert tok.decode(tok.encode(text).ids) == text
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    assert hf.decode(hf.encode(text)) == text
    assert hf.eos_token_id == 0
    # Training is deterministic: same files, same tokenizer.json.
    again = train_bpe_tokenizer([str(corpus["root"] / "*")], vocab_size=400, out_path=tmp_path / "t.json")
    assert again.read_bytes() == path.read_bytes()


def test_tokenizer_on_real_stdlib_slice(tmp_path: Path) -> None:
    files = stdlib_files(max_files=20)
    path = train_bpe_tokenizer(files, vocab_size=600, out_path=tmp_path / "tokenizer.json")
    tok = load_tokenizer(path)
    source = files[0].read_text(encoding="utf-8")
    assert tok.decode(tok.encode(source).ids) == source


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json") as info:
        load_tokenizer(tmp_path)  # a directory holding tokenizer.json works too
    assert "\n" not in str(info.value)


def test_eos_lookup_and_missing_eos() -> None:
    llama_like = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<unk>"))
    assert eos_id(llama_like) == 2
    no_eos = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(DataError, match="no end-of-document token"):
        eos_id(no_eos)


# --- prepare ---------------------------------------------------------------------------------


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


# --- dataset validation ----------------------------------------------------------------------


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


def test_dataset_open_properties(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared, verify=True)
    assert dataset.vocab_size <= 400 and dataset.eos_id == 0 and dataset.dtype == np.uint16
    assert dataset.train_tokens == sum(len(s) for s in dataset.train_shards) > 0
    assert dataset.val_tokens == len(dataset.val) > 0
    assert len(dataset.tokenizer_sha256) == 64


def _open_error(path: Path, verify: bool = False) -> str:
    with pytest.raises(DataError) as info:
        TokenDataset.open(path, verify=verify)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_truncated_shard_is_a_data_error(prepared: Path) -> None:
    shard = prepared / "train_00001.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-200])
    assert "shard train_00001.npy is corrupt: expected 1500 tokens, found 1400" in _open_error(prepared)


def test_garbage_shard_is_a_data_error(prepared: Path) -> None:
    shard = prepared / "train_00000.npy"
    size = shard.stat().st_size
    shard.write_bytes(np.random.default_rng(0).bytes(size))
    assert "shard train_00000.npy is corrupt: not a valid .npy file" in _open_error(prepared)


def test_overwritten_token_bytes_are_caught(prepared: Path) -> None:
    shard = prepared / "train_00000.npy"
    data = bytearray(shard.read_bytes())
    data[200:204] = b"\x01\x00\x02\x00"  # valid ids, same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    TokenDataset.open(prepared)  # cheap checks pass
    assert "sha256 does not match" in _open_error(prepared, verify=True)
    data[-2:] = b"\xff\xff"  # id 65535 >= vocab size: caught by the cheap id check
    shard.write_bytes(bytes(data))
    assert "token id 65535 >= vocab size" in _open_error(prepared)


def test_manifest_and_tokenizer_problems(prepared: Path, tmp_path: Path) -> None:
    assert "no manifest.json" in _open_error(tmp_path)
    manifest = json.loads((prepared / "manifest.json").read_text())
    (prepared / "manifest.json").write_text(json.dumps(manifest | {"dtype": "float32"}))
    assert "dtype 'float32'" in _open_error(prepared)
    (prepared / "manifest.json").write_text(json.dumps(manifest | {"train": [{"file": "../x.npy"}]}))
    assert "missing field" in _open_error(prepared)
    (prepared / "manifest.json").write_text("{")
    assert "not valid JSON" in _open_error(prepared)
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    (prepared / "val.npy").unlink()
    assert "shard val.npy is missing" in _open_error(prepared)
    (prepared / "tokenizer.json").write_text("{}")
    assert "does not match the manifest" in _open_error(prepared)


# --- sampling --------------------------------------------------------------------------------


def test_sampler_batches_resume_and_seeds(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    sampler = WindowSampler(dataset, seq_len=32, batch_size=4, seed=7)
    first = sampler.next_batch()
    assert first.dtype == torch.long and first.shape == (4, 33)
    # Every row is a real window of some shard.
    shards = [np.asarray(s, dtype=np.int64) for s in dataset.train_shards]
    for row in first.numpy():
        assert any(
            np.array_equal(s[i : i + 33], row)
            for s in shards
            for i in np.flatnonzero(s[: len(s) - 32] == row[0])
        )
    for _ in range(3):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))  # survives JSON
    expected = [sampler.next_batch() for _ in range(5)]
    resumed = WindowSampler(dataset, seq_len=32, batch_size=4, seed=12345)
    resumed.load_state_dict(state)
    assert resumed.batches == 4
    for batch in expected:
        assert torch.equal(resumed.next_batch(), batch)
    same = WindowSampler(dataset, seq_len=32, batch_size=4, seed=7)
    other = WindowSampler(dataset, seq_len=32, batch_size=4, seed=8)
    assert torch.equal(same.next_batch(), first)
    assert not torch.equal(other.next_batch(), first)
    with pytest.raises(DataError, match="seq_len=32"):
        WindowSampler(dataset, seq_len=16, batch_size=4, seed=7).load_state_dict(state)


def test_sampler_too_little_data(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    with pytest.raises(DataError, match="too little training data"):
        WindowSampler(dataset, seq_len=5000, batch_size=2, seed=0)


def test_validation_batches_are_fixed_consecutive_windows(prepared: Path) -> None:
    dataset = TokenDataset.open(prepared)
    batches = validation_batches(dataset, seq_len=16, batch_size=3, max_batches=4)
    assert len(batches) == 4 and all(b.shape == (3, 17) and b.dtype == torch.long for b in batches)
    flat = torch.cat(batches).reshape(-1).numpy()
    assert np.array_equal(flat, np.asarray(dataset.val[: 4 * 3 * 17], dtype=np.int64))
    again = validation_batches(TokenDataset.open(prepared), seq_len=16, batch_size=3, max_batches=4)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    with pytest.raises(DataError, match="validation split"):
        validation_batches(dataset, seq_len=len(dataset.val), batch_size=1)


# --- CLI -------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(REPO_ROOT)}


def test_cli_corrupt_input_exits_2_with_one_error_line(corpus: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    result = subprocess.run(
        [sys.executable, "-m", "swarm.data.cli", "prepare", "--input", str(bad)]
        + ["--tokenizer", str(corpus["tokenizer"]), "--out", str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=_env(),
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.jsonl:2" in lines[0], result.stderr


def test_cli_round_trip_in_process(corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = tmp_path / "tok.json"
    inputs = ["--input", str(corpus["root"] / "*.jsonl"), "-i", str(corpus["root"] / "*.txt")]
    assert cli_main(["train-tokenizer", *inputs, "--vocab-size", "300", "--out", str(tok)]) == 0
    out = tmp_path / "data"
    args = ["prepare", *inputs, "--tokenizer", str(tok), "--out", str(out), "--workers", "1", "-q"]
    assert cli_main([*args, "--val-fraction", "0.2"]) == 0
    assert cli_main(["inspect", str(out), "--verify"]) == 0
    assert "sha256 verified" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no manifest.json")


# --- embedded stdlib corpus --------------------------------------------------------------------

_BUILD_SCRIPT = """
import logging, sys
from pathlib import Path
from swarm.data.stdlib_corpus import ensure_stdlib_dataset
logging.basicConfig(level=logging.INFO, format="%(message)s")
if __name__ == "__main__":
    print(ensure_stdlib_dataset(Path(sys.argv[1]), vocab_size=320, progress=False, max_files=25))
"""


def test_ensure_stdlib_dataset_concurrent_build_happens_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=_env(),
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    assert sum(err.count("building stdlib dataset") for _, err in results) == 1, results
    data_dir = Path(paths.pop())
    dataset = TokenDataset.open(data_dir, verify=True)
    assert dataset.vocab_size <= 320 and dataset.train_tokens > 0 and dataset.val_tokens > 0
    # Only the finished dataset and the lock file remain; a later call reuses it.
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [data_dir.name]
    from swarm.data import ensure_stdlib_dataset

    assert ensure_stdlib_dataset(cache, vocab_size=320, progress=False, max_files=25) == data_dir
