"""The training loop, checkpoints, metrics, progress and plots."""

from moebal.train.checkpoint import (
    CheckpointReader,
    latest_good_checkpoint,
    read_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from moebal.train.hooks import Hook
from moebal.train.optim import build_optimizer, lr_at
from moebal.train.trainer import RunResult, Trainer, default_device, default_threads

__all__ = [
    "CheckpointReader",
    "Hook",
    "RunResult",
    "Trainer",
    "build_optimizer",
    "default_device",
    "default_threads",
    "latest_good_checkpoint",
    "lr_at",
    "read_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
