"""Bits per byte on a run's held-out validation shard (the ``val.npy`` that ``swarm-data prepare`` wrote).

Usage::

    res = validation_bpb(hf_model, dataset, seq_len=256, batch_size=8, max_batches=None)
    res["bpb"], res["loss"], res["tokens"], res["bytes"]

The windows are ``swarm.data.validation_batches``: consecutive, non-overlapping ``seq_len + 1`` token
windows from the start of the shard, the same ones the trainer's ``val_loss`` uses (its first
``data.val_batches``). Each window predicts its last ``seq_len`` tokens. ``loss`` is the mean cross-entropy
in nats per predicted token (comparable with ``val_loss`` in ``metrics.jsonl``); ``bpb`` is the summed
cross-entropy in bits divided by the UTF-8 bytes those predicted tokens decode to. Special tokens (the
end-of-document separator) count 0 bytes but their loss counts: the model must predict them too.

Bytes per token: for byte-level BPE (ours, GPT-2, Qwen, Llama 3) each token's string maps back to its
exact bytes through the byte-level alphabet; for other decoders each token is decoded alone, which can
miscount a token that holds part of a multi-byte character.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, pre_tokenizers

from swarm.data import TokenDataset


def _byte_level_table() -> dict[str, int]:
    """The inverse of the byte-level alphabet: printable stand-in character -> byte value."""
    # The 188 printable bytes map to themselves; the other 68 to chr(256 + n) in byte order (GPT-2's table).
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    return table


def token_byte_lengths(tok: Tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes of each token id (0 for special tokens and ids the tokenizer does not have)."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    table = _byte_level_table() if byte_level else {}
    for text, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx >= vocab_size or text in specials:
            continue
        if byte_level and all(ch in table for ch in text):
            lengths[idx] = len(text)  # one stand-in character per byte
        else:
            lengths[idx] = len(tok.decode([idx], skip_special_tokens=False).encode("utf-8"))
    return lengths


@torch.no_grad()
def validation_bpb(
    model,
    dataset: TokenDataset,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Loss (nats/token) and bits per byte of a causal LM (``model(ids).logits``) on the validation shard."""
    from swarm.data import validation_batches

    byte_len = torch.from_numpy(
        token_byte_lengths(Tokenizer.from_file(str(dataset.tokenizer_path)), dataset.vocab_size)
    )
    nats, tokens, nbytes = 0.0, 0, 0
    model.eval()
    for batch in validation_batches(dataset, seq_len, batch_size, max_batches):
        batch = batch.to(device)
        logits = model(batch[:, :-1]).logits.float()
        targets = batch[:, 1:]
        nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        tokens += targets.numel()
        nbytes += int(byte_len[targets.cpu()].sum())
    return {
        "loss": nats / tokens,
        "bpb": nats / math.log(2) / max(nbytes, 1),
        "tokens": tokens,
        "bytes": nbytes,
    }
