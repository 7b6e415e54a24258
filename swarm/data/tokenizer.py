"""Training, loading and inspecting byte-level BPE tokenizers (HF ``tokenizer.json`` files)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from swarm.data.errors import DataError
from swarm.data.sources import expand_inputs, iter_documents

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer families, most specific first:
# GPT-2/Qwen/our own, Llama 3, Llama 2/Mistral/T5, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# 256 byte symbols + <|endoftext|>: anything smaller cannot encode arbitrary text.
MIN_VOCAB_SIZE = 257


def train_bpe_tokenizer(
    files: Sequence[str | Path],
    vocab_size: int,
    out_path: str | Path,
    min_frequency: int = 2,
    text_field: str = "text",
) -> Path:
    """Train a byte-level BPE tokenizer on ``files`` and save it atomically as ``out_path``.

    ``files`` may hold paths, directories or globs of any input type ``prepare`` reads. The
    special token ``<|endoftext|>`` gets id 0. The result loads with ``tokenizers.Tokenizer``
    and ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"vocab size {vocab_size} is too small (minimum {MIN_VOCAB_SIZE}: 256 bytes + eos)")
    paths = expand_inputs(files)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        # Seeding all 256 byte symbols guarantees every input is encodable, even bytes that never
        # occur in the training files.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def documents() -> Iterator[str]:
        for path in paths:
            yield from iter_documents(path, text_field)

    tokenizer.train_from_iterator(documents(), trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a HF ``tokenizer.json`` (or a directory containing one), raising DataError if unusable."""
    file = resolve_tokenizer_path(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises bare Exception for every parse problem
        raise DataError(f"{file} is not a valid tokenizer.json: {exc}") from exc


def resolve_tokenizer_path(path: str | Path) -> Path:
    """Return the tokenizer file for ``path`` (a file or a directory with ``tokenizer.json``)."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"tokenizer file not found: {file}")
    return file


def eos_id(tokenizer: Tokenizer) -> int:
    """Return the id of the end-of-document token (``<|endoftext|>``, ``</s>``, ...)."""
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise DataError(f"tokenizer has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)})")


def vocab_size(tokenizer: Tokenizer) -> int:
    """Return one more than the largest token id, i.e. the embedding rows a model needs.

    ``get_vocab_size`` can undercount when added tokens have ids beyond the base vocabulary,
    so the maximum id is used instead.
    """
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0
