"""Find a swarm checkpoint, its run config and its tokenizer from whatever path a user gives.

Usage::

    ck = open_run_checkpoint("runs/demo")          # run dir: its latest checkpoint
    ck = open_run_checkpoint("runs/demo/checkpoints/step_00000300")
    ck.cfg, ck.state, ck.step, ck.tokens           # RunConfig, canonical fp32 tensors (every expert)
    tokenizer_file(ck.cfg)                         # the tokenizer.json the run's data was made with

A checkpoint directory (``state.json`` + ``model.safetensors``) lives in ``RUN/checkpoints/``; the run's
resolved config is ``RUN/config.yaml``. A peer's checkpoint holds the whole model in canonical form: its
local experts as trained, every other expert as its latest copy from the swarm. Only ``model.safetensors``
is read (the optimizer moments are not needed), with the same checks as ``load_checkpoint``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from swarm.config import ConfigError, RunConfig, load_config
from swarm.data import DataError, Manifest, ensure_stdlib_dataset
from swarm.data.tokenizer import resolve_tokenizer_path
from swarm.model import MoETransformer
from swarm.train.checkpoint import FORMAT_VERSION, CheckpointError, latest_checkpoint, list_checkpoints


@dataclass
class RunCheckpoint:
    path: Path  # the step directory
    run_dir: Path
    cfg: RunConfig
    state: dict[str, torch.Tensor]
    step: int
    tokens: int


def is_swarm_checkpoint(path: str | Path) -> bool:
    """A step directory, a ``checkpoints/`` directory or a run directory (as opposed to a HF model dir)."""
    p = Path(path)
    return (p / "state.json").is_file() or (p / "checkpoints").is_dir() or bool(list_checkpoints(p))


def _locate(path: Path) -> tuple[Path, Path]:
    """(step dir, run dir) for a step dir, a checkpoints dir or a run dir."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "state.json").is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, run_dir
    for ckpt_dir, run_dir in ((path / "checkpoints", path), (path, path.parent)):
        step_dir = latest_checkpoint(ckpt_dir)
        if step_dir is not None:
            return step_dir, run_dir
    raise CheckpointError(f"{path} holds no swarm checkpoint (no state.json, no checkpoints/step_*)")


def _load_model_tensors(step_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        state = json.loads((step_dir / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {step_dir} is corrupt: state.json is not valid JSON") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION or "step" not in state:
        raise CheckpointError(f"checkpoint {step_dir}: unknown format (expected format {FORMAT_VERSION})")
    f, size = step_dir / "model.safetensors", state.get("files", {}).get("model.safetensors")
    if not f.is_file() or size is None:
        raise CheckpointError(f"checkpoint {step_dir} is incomplete: model.safetensors missing")
    if f.stat().st_size != size:
        raise CheckpointError(f"checkpoint {step_dir} is corrupt: model.safetensors has the wrong size")
    try:
        return state, load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir} is corrupt: model.safetensors: {e}") from None


def check_canonical(state: dict[str, torch.Tensor], cfg: RunConfig, where: Path) -> None:
    """Every canonical tensor of ``cfg.model`` present with its shape (checked on the meta device)."""
    with torch.device("meta"):
        want = MoETransformer(cfg.model).canonical_shapes()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {where} does not match its config.yaml: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"checkpoint {where}: {name} has shape {tuple(state[name].shape)}, config says {shape}"
            )


def open_run_checkpoint(path: str | Path) -> RunCheckpoint:
    """Load the model weights and run config of a checkpoint. CheckpointError/ConfigError: one line."""
    step_dir, run_dir = _locate(Path(path))
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"no config.yaml for checkpoint {step_dir} (looked for {cfg_path})")
    cfg = load_config(cfg_path)
    state, tensors = _load_model_tensors(step_dir)
    if state.get("fingerprint") not in (None, cfg.fingerprint()):
        raise CheckpointError(f"checkpoint {step_dir} belongs to another model than {cfg_path}")
    check_canonical(tensors, cfg, step_dir)
    return RunCheckpoint(
        step_dir,
        run_dir,
        cfg,
        {k: v.float() for k, v in tensors.items()},
        state["step"],
        state.get("tokens", 0),
    )


def tokenizer_file(cfg: RunConfig) -> Path:
    """The run's tokenizer: ``data.tokenizer`` if set, else the one its prepared data (or the embedded
    stdlib corpus, built on first use) was tokenized with."""
    try:
        if cfg.data.tokenizer:
            return resolve_tokenizer_path(cfg.data.tokenizer)
        if cfg.data.path == "stdlib":
            data_dir = ensure_stdlib_dataset(
                cfg.data.cache_dir, vocab_size=cfg.data.stdlib_vocab_size, progress=False
            )
        else:
            data_dir = Path(cfg.data.path)
        return resolve_tokenizer_path(data_dir / Manifest.load(data_dir).tokenizer_file)
    except DataError as e:
        raise ConfigError(f"cannot find the run's tokenizer ({e}); pass --tokenizer FILE") from None
