"""moebal's error types: every user-input error is one of these, with a message that names the fix."""

from __future__ import annotations


class MoebalError(Exception):
    """Base of every error moebal raises on purpose (bad input, not a bug)."""


class ConfigError(MoebalError, ValueError):
    """A config file, override or CLI value is malformed or impossible."""


class DataError(MoebalError, ValueError):
    """A corpus, tokenizer or sample cannot be used."""


class CheckpointError(MoebalError, ValueError):
    """A checkpoint is missing, corrupt or does not match the model."""


class TrainingError(MoebalError, RuntimeError):
    """Training cannot go on as configured (the loss or the gradient norm stopped being finite)."""
