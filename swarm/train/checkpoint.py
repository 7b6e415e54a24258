"""Atomic checkpoints: safetensors for weights and optimizer moments, JSON for everything else.

Layout of ``run_dir/checkpoints/step_00000500/``: ``model.safetensors`` (canonical fp32 weights, every
expert), ``optimizer.safetensors`` (AdamW moments keyed by parameter name), ``state.json`` (step, tokens,
sampler state, local experts, config fingerprint, file sizes). A checkpoint is written into a hidden
temporary directory, fsynced, then renamed into place, so a kill at any moment leaves either the complete
new checkpoint or none: the latest visible checkpoint always loads. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
_PREFIX = "step_"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, corrupt or from another run. The message is one line."""


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _fault_point(name: str, step: int) -> None:
    """Fault injection for tests: ``SWARM_FAULT_KILL_AT=name@step`` SIGKILLs this process right here."""
    if os.environ.get("SWARM_FAULT_KILL_AT") == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the ``keep`` newest. Returns its path."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{_PREFIX}{step:08d}"
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model.items()}, str(tmp / "model.safetensors"))
    _fault_point("model_written", step)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in optimizer.items()}, str(tmp / "optimizer.safetensors")
    )
    _fault_point("optimizer_written", step)
    files = {name: (tmp / name).stat().st_size for name in ("model.safetensors", "optimizer.safetensors")}
    full_state = {"format": FORMAT_VERSION, "step": step, "files": files, **state}
    (tmp / "state.json").write_text(json.dumps(full_state, indent=1))
    for name in (*files, "state.json"):
        _fsync_file(tmp / name)
    _fsync_dir(tmp)
    _fault_point("before_rename", step)
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        trash = ckpt_dir / f".old-{final.name}-{os.getpid()}"
        os.rename(final, trash)
        _fault_point("old_moved_aside", step)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(ckpt_dir)
    _fault_point("before_prune", step)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    _remove_stale_temporaries(ckpt_dir)
    return final


def _remove_stale_temporaries(ckpt_dir: Path) -> None:
    """Temporaries left by a killed writer (another pid) are garbage: they were never renamed into place."""
    for p in ckpt_dir.glob(".tmp-*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def _recover_moved_aside(ckpt_dir: Path) -> None:
    """A writer killed between moving an old checkpoint aside and renaming its replacement into place
    leaves ``.old-step_N-pid`` and no ``step_N``: the old copy is complete, so put it back."""
    for old in ckpt_dir.glob(f".old-{_PREFIX}*"):
        final = ckpt_dir / old.name[len(".old-") :].rsplit("-", 1)[0]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Completed checkpoints, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    _recover_moved_aside(ckpt_dir)
    found = [
        p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify one checkpoint directory. Raises CheckpointError naming what is wrong."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: state.json missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path} is corrupt: state.json is not valid JSON") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION or "step" not in state:
        raise CheckpointError(f"checkpoint {path}: unknown format (expected format {FORMAT_VERSION})")
    tensors = {}
    for name, size in state.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {f.stat().st_size} bytes, expected {size}"
            )
        try:
            tensors[name] = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name}: {e}") from None
    if set(tensors) != {"model.safetensors", "optimizer.safetensors"}:
        raise CheckpointError(f"checkpoint {path} is incomplete: weight files not listed in state.json")
    return Checkpoint(path, tensors["model.safetensors"], tensors["optimizer.safetensors"], state)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None
