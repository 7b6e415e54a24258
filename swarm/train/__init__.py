"""The local trainer: optimizer over trainable parameters, schedule, checkpoints, metrics, local ranks."""

from swarm.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from swarm.train.local_ranks import LocalRanks
from swarm.train.memory import training_state_bytes
from swarm.train.optimizer import build_optimizer, set_lr
from swarm.train.sync_hook import NoSync, StepReport, SyncHook
from swarm.train.trainer import Trainer

__all__ = [
    "CheckpointError",
    "LocalRanks",
    "NoSync",
    "StepReport",
    "SyncHook",
    "Trainer",
    "build_optimizer",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "set_lr",
    "training_state_bytes",
]
