"""The run's tokenizer as a Hugging Face fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``).

Usage::

    tok = hf_tokenizer(Path("data/mine/tokenizer.json"), model_max_length=2048, vocab_size=32000)
    save_tokenizer(tok, out_dir)        # AutoTokenizer.from_pretrained(out_dir) then works offline

A bare ``tokenizer.json`` (ours, from ``swarm-data train-tokenizer`` or the stdlib corpus) gets its
end-of-document token (``<|endoftext|>``, ``</s>``, ...) as eos, and the same token as bos and pad: the
models are trained on documents joined by that token, there is no separate bos, and lm-eval and
``generate`` need a pad id. A tokenizer directory with its own ``tokenizer_config.json`` (a dense model's,
copied by ``swarm-upcycle``) keeps its special tokens and chat template; only a missing pad is set to eos.
"""

from __future__ import annotations

import json
from pathlib import Path

from swarm.data import DataError, eos_id, load_tokenizer
from swarm.data.tokenizer import vocab_size as tokenizer_vocab_size
from swarm.hf.errors import HFError

# Written instead of transformers 5's "TokenizersBackend" so that transformers 4 loads the directory too;
# transformers 5 maps this name to the same class.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def hf_tokenizer(tokenizer_json: Path, model_max_length: int, vocab_size: int):
    """A ``PreTrainedTokenizerFast`` for ``tokenizer_json``; HFError if unusable or larger than the model."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        raw = load_tokenizer(tokenizer_json)
        if tokenizer_vocab_size(raw) > vocab_size:
            raise HFError(
                f"tokenizer {tokenizer_json} has {tokenizer_vocab_size(raw)} tokens, more than the "
                f"model's vocab_size {vocab_size}: it is not this model's tokenizer"
            )
        directory = Path(tokenizer_json).parent
        if (directory / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        else:
            eos = raw.id_to_token(eos_id(raw))
            tok = PreTrainedTokenizerFast(
                tokenizer_object=raw, eos_token=eos, bos_token=eos, pad_token=eos, unk_token=None
            )
    except DataError as e:
        raise HFError(str(e)) from None
    except (OSError, ValueError) as e:
        raise HFError(f"cannot load tokenizer {tokenizer_json}: {e}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.model_max_length = model_max_length
    return tok


def save_tokenizer(tok, out_dir: Path) -> dict[str, int | None]:
    """Write the tokenizer files into ``out_dir``; return the bos/eos/pad ids for the model config."""
    tok.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = TOKENIZER_CLASS
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
