"""``swarm-peer``: one training participant.

    swarm-peer --config configs/demo.yaml --solo --run-dir runs/demo [--max-steps N] [--resume]

Bad input (config, data, tokenizer, checkpoint) prints one ``error:`` line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from swarm.config import ConfigError, load_config
from swarm.data import DataError
from swarm.model import BackendUnavailable
from swarm.train import CheckpointError, NoSync, Trainer
from swarm.train.cpu_allocator import keep_freed_memory
from swarm.train.trainer import pick_device

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="swarm-peer", description="Train one peer of a swarm MoE run.")
    ap.add_argument("--config", required=True, help="YAML preset, e.g. configs/demo.yaml")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.lr=3e-4 (repeatable)",
    )
    ap.add_argument("--solo", action="store_true", help="train alone, with no swarm")
    ap.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="join a swarm (next release)"
    )
    ap.add_argument(
        "--run-dir", default="runs/peer", help="metrics.jsonl, config.yaml and checkpoints/ go here"
    )
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir")
    ap.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps in total"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def _terminate(signum, frame):  # SIGTERM behaves like Ctrl+C: checkpoint, then leave
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = None
    try:
        cfg = load_config(args.config, args.set)
        if not args.solo:
            raise ConfigError("--initial-peers: swarm training is not available yet; run with --solo")
        if args.max_steps is not None and args.max_steps < 0:
            raise ConfigError("--max-steps: must be >= 0")
        signal.signal(signal.SIGTERM, _terminate)
        if pick_device(cfg.train.device).type == "cpu":
            keep_freed_memory()
        trainer = Trainer(cfg, Path(args.run_dir), sync=NoSync(), progress=not args.no_progress)
        trainer.setup(resume=args.resume)
        summary = trainer.train(args.max_steps)
        if "initial_val_loss" in summary:
            a, b = summary["initial_val_loss"], summary["final_val_loss"]
            print(
                f"validation loss {a:.3f} -> {b:.3f} ({(b - a) / a:+.0%}) after {summary['end_step']} steps, "
                f"{summary['tokens']:,} tokens; run dir {args.run_dir}",
                file=sys.stderr,
            )
        print(json.dumps({"run_dir": str(args.run_dir), **summary}))
        return 0
    except (ConfigError, DataError, CheckpointError, BackendUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    finally:
        if trainer is not None:
            trainer.close()


if __name__ == "__main__":
    raise SystemExit(main())
