"""The training loop (one for every mode, a step strategy per mode), checkpoints, metrics, progress and plots.

`PipelineStep` (moebal/train/pipelined.py) is imported from its module: it pulls in the pipeline engine.
"""

from moebal.train.checkpoint import (
    CheckpointReader,
    latest_good_checkpoint,
    read_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from moebal.train.hooks import Hook
from moebal.train.local import LocalStep
from moebal.train.optim import build_optimizer, lr_at
from moebal.train.strategy import StepOutput, StepStrategy
from moebal.train.trainer import RunResult, Trainer, default_device, default_threads

__all__ = [
    "CheckpointReader",
    "Hook",
    "LocalStep",
    "RunResult",
    "StepOutput",
    "StepStrategy",
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
