"""A run directory's checks before a trainer writes to it: the checkpoint to resume from, and that it
holds no other model's run."""

from __future__ import annotations

import sys
from pathlib import Path

from swarm.config import ConfigError, RunConfig, load_config
from swarm.train.checkpoint import Checkpoint, CheckpointError, latest_checkpoint, load_checkpoint


def find_checkpoint(run_dir: Path, cfg: RunConfig, resume: bool) -> Checkpoint | None:
    """The checkpoint to resume from (checked against ``cfg``), or None for a fresh start. Raises
    CheckpointError for a run dir with checkpoints but no ``resume``, or a checkpoint of another run."""
    ckpts = run_dir / "checkpoints"
    existing = latest_checkpoint(ckpts)
    if existing is not None and not resume:
        raise CheckpointError(
            f"run dir {run_dir} already has checkpoints (latest {existing.name}); "
            "pass --resume to continue it or choose another --run-dir"
        )
    if not resume or existing is None:
        if resume:
            print(f"no checkpoint in {ckpts}; starting from scratch", file=sys.stderr)
        return None
    ckpt = load_checkpoint(existing)
    if ckpt.state.get("fingerprint") != cfg.fingerprint():
        raise CheckpointError(f"checkpoint {existing} belongs to another model/run (fingerprint differs)")
    local = ckpt.state.get("local_experts")
    if not isinstance(local, list) or not all(
        isinstance(e, int) and 0 <= e < cfg.model.n_experts for e in local
    ):
        raise CheckpointError(f"checkpoint {existing}: invalid local_experts {local!r}")
    return ckpt


def check_run_dir(run_dir: Path, cfg: RunConfig) -> None:
    """Create ``run_dir``; ConfigError if its saved config is another model's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = run_dir / "config.yaml"
    if saved.exists():
        try:
            old = load_config(saved)
        except ConfigError:
            old = None
        if old is not None and old.fingerprint() != cfg.fingerprint():
            raise ConfigError(
                f"run dir {run_dir} holds a run with a different model config; use another --run-dir"
            )
