"""``swarm-peer --init-from DIR``: start a fresh run from existing weights instead of a random init.

Usage::

    state = load_init_weights("hf/demo", cfg, run_dir, resume=False)   # before Trainer.setup
    trainer.setup(...)
    apply_init_weights(trainer, state)                                 # before the first step

DIR is a Hugging Face model directory (what ``swarm-export`` writes, or any OLMoE / Qwen3-MoE / Mixtral
model our transformer can represent) or a swarm checkpoint (what ``swarm-upcycle`` writes, or another
run's). Its model must equal the run's ``model`` section in every field that decides the function
(``architectures.MATH_FIELDS``); otherwise ConfigError, raised before anything is written to the run dir.
When ``--resume`` finds a checkpoint, that checkpoint wins and DIR is ignored.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from swarm.config import ConfigError, ModelConfig, RunConfig
from swarm.data import DataError
from swarm.hf.architectures import from_hf_state_dict, model_config_from_hf, model_differences
from swarm.hf.errors import HFError
from swarm.hf.run_checkpoint import is_swarm_checkpoint, open_run_checkpoint
from swarm.train.checkpoint import CheckpointError, latest_checkpoint


def read_hf_config(path: Path):
    """The HF config of model dir ``path`` (offline), or HFError."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise HFError(
            f"{path} is neither a Hugging Face model directory (no config.json) nor a swarm checkpoint"
        )
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise HFError(f"{path}/config.json cannot be read: {e}") from None


def read_hf_weights(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical fp32 tensors of HF model dir ``path`` (any layout ``from_pretrained`` reads)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise HFError(f"cannot load the weights in {path}: {e}") from None
    return from_hf_state_dict(model.state_dict(), cfg)


def load_init_weights(
    source: str | Path, cfg: RunConfig, run_dir: Path, resume: bool
) -> dict[str, torch.Tensor] | None:
    """Canonical weights to start from, or None when ``--resume`` continues an existing checkpoint.
    ConfigError (one line) for a missing/unreadable DIR or a model that differs from the run's."""
    source = Path(source)
    existing = latest_checkpoint(Path(run_dir) / "checkpoints")
    if resume and existing is not None:
        print(f"--init-from {source} ignored: resuming from {existing}", file=sys.stderr)
        return None
    try:
        if not source.exists():
            raise HFError(f"{source} does not exist")
        if is_swarm_checkpoint(source):
            ck = open_run_checkpoint(source)
            theirs = ck.cfg.model
        else:
            ck, theirs = None, model_config_from_hf(read_hf_config(source))
        diffs = model_differences(cfg.model, theirs)
        if diffs:
            raise HFError(f"its model differs from the run's (run vs DIR): {'; '.join(diffs[:4])}")
        state = ck.state if ck is not None else read_hf_weights(source, cfg.model)
    except (HFError, CheckpointError, DataError, ConfigError) as e:
        raise ConfigError(f"--init-from {source}: {e}") from None
    return state


def apply_init_weights(trainer, state: dict[str, torch.Tensor] | None, source: str | Path = "") -> None:
    """Copy ``state`` into a freshly set-up trainer's model (in place: the optimizer keeps its parameters)."""
    if state is None or trainer.step != 0:
        return
    trainer.model.load_canonical_state_dict(state)
    print(f"initialised the model from {source}", file=sys.stderr)
