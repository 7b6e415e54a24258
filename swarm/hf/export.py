"""``swarm-export``: a swarm checkpoint as a Hugging Face model directory that loads offline.

    swarm-export runs/demo hf/demo                  # the run's latest checkpoint
    swarm-export runs/demo/checkpoints/step_00000300 hf/demo --dtype bfloat16
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/demo')"

The directory holds ``config.json`` + ``generation_config.json`` + ``model.safetensors`` (the class that
computes our function: ``OlmoeForCausalLM`` by default, see ``architectures.py``), the tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``) and ``swarm_export.json`` (source checkpoint, step, tokens
and the run config, which ``swarm-eval`` uses to find the validation shard). It is staged in a temporary
directory, reloaded with ``from_pretrained`` and its logits compared with ours, then renamed into place:
an existing OUT_DIR is never touched unless ``--force``.

``max_position_embeddings`` is the evaluation window, ``--context`` (default: the larger of
``model.max_seq_len`` and 2048, lm-eval's default window): RoPE has no hard limit, and lm-eval refuses an
answer longer than the window (piqa has answers of 400+ tokens with a 4k vocabulary). The window the model
was trained on is recorded as ``trained_seq_len`` in ``swarm_export.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ConfigError
from swarm.data import DataError
from swarm.hf.architectures import hf_config_for, to_hf_state_dict
from swarm.hf.errors import HFError
from swarm.hf.run_checkpoint import RunCheckpoint, open_run_checkpoint, tokenizer_file
from swarm.hf.tokenizer_export import hf_tokenizer, save_tokenizer
from swarm.model import MoETransformer
from swarm.train.checkpoint import CheckpointError

EXIT_BAD_INPUT = 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CONTEXT = 2048


@dataclass
class ExportReport:
    out_dir: Path
    architecture: str
    step: int
    max_abs_diff: float | None  # logits of the reloaded HF model vs ours; None when not verified


def write_hf_model(state: dict[str, torch.Tensor], cfg, out_dir: Path, dtype: str, **config_extra) -> str:
    """Save canonical ``state`` of model config ``cfg`` as a HF model in ``out_dir``; returns the class."""
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config_for(cfg, **config_extra)
    hf_cfg.dtype = dtype
    with torch.device("meta"):  # no random init of a model we overwrite at once
        model = AutoModelForCausalLM.from_config(hf_cfg)
    tensors = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in to_hf_state_dict(state).items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(str(out_dir))
    return type(model).__name__


@torch.no_grad()
def logits_difference(state: dict[str, torch.Tensor], cfg, hf_dir: Path) -> tuple[float, float]:
    """(max |ours - HF|, max |ours|) of the logits on a fixed random batch, HF model loaded from disk."""
    from transformers import AutoModelForCausalLM

    ours = MoETransformer(cfg)
    ours.load_canonical_state_dict(state)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    x = torch.randint(
        0, cfg.vocab_size, (2, min(32, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0)
    )
    a, b = ours.eval()(x).logits, hf(x).logits
    return (a - b).abs().max().item(), a.abs().max().item()


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    verify: bool = True,
    force: bool = False,
    checkpoint: RunCheckpoint | None = None,
    context: int | None = None,
) -> ExportReport:
    """Export checkpoint ``source`` (step dir, checkpoints dir or run dir) to ``out_dir`` (see module doc)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise HFError(f"{out_dir} already exists and is not empty; choose another OUT_DIR or pass --force")
    ck = checkpoint or open_run_checkpoint(source)
    cfg = ck.cfg.model
    if context is not None and context < 1:
        raise HFError("--context: must be >= 1")
    context = context or max(cfg.max_seq_len, DEFAULT_CONTEXT)
    tok = hf_tokenizer(Path(tokenizer) if tokenizer else tokenizer_file(ck.cfg), context, cfg.vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        special = save_tokenizer(tok, tmp)
        arch = write_hf_model(ck.state, dataclasses.replace(cfg, max_seq_len=context), tmp, dtype, **special)
        meta = {
            "source": str(ck.path.resolve()),
            "step": ck.step,
            "tokens": ck.tokens,
            "architecture": arch,
            "dtype": dtype,
            "trained_seq_len": cfg.max_seq_len,
            "run_config": ck.cfg.to_dict(),
        }
        (tmp / "swarm_export.json").write_text(json.dumps(meta, indent=1) + "\n")
        diff = None
        if verify:
            diff, scale = logits_difference(ck.state, cfg, tmp)
            tol = (1e-4 if dtype == "float32" else 5e-2) * max(1.0, scale)
            if not diff <= tol:
                raise HFError(
                    f"exported model disagrees with the checkpoint: max logit difference {diff:.3g}"
                )
        if out_dir.exists():  # --force: replace only now that the new export is complete
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportReport(out_dir, arch, ck.step, diff)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-export", description="Export a swarm checkpoint as a HF model.")
    ap.add_argument("checkpoint", help="checkpoint dir (checkpoints/step_N), checkpoints/ dir or run dir")
    ap.add_argument("out_dir", help="the Hugging Face model directory to write")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json to ship (default: the run's own)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weights on disk")
    ap.add_argument(
        "--context", type=int, default=None, help="max_position_embeddings (default max(trained, 2048))"
    )
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    ap.add_argument("--no-verify", action="store_true", help="skip reloading and comparing logits")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
    try:
        rep = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            args.tokenizer,
            args.dtype,
            not args.no_verify,
            args.force,
            context=args.context,
        )
    except (HFError, CheckpointError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    diff = "not verified" if rep.max_abs_diff is None else f"max logit difference {rep.max_abs_diff:.2e}"
    print(f"exported step {rep.step} as {rep.architecture} to {rep.out_dir} ({diff})", file=sys.stderr)
    print(
        json.dumps(
            {
                "out_dir": str(rep.out_dir),
                "architecture": rep.architecture,
                "step": rep.step,
                "max_abs_diff": rep.max_abs_diff,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
