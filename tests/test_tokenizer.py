"""The tokenizer (swarm.data.tokenizer): training, loading (in transformers too), round trips, EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from swarm.data import DataError, load_tokenizer, train_bpe_tokenizer
from swarm.data.stdlib_corpus import stdlib_files
from swarm.data.tokenizer import eos_id


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
