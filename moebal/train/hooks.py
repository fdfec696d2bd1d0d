"""Extension points of the training loop.

Later capabilities plug in here instead of branching inside the trainer or the model:

- gradient synchronisation (data parallel all-reduce, Pro-Prophet's Agg of replica gradients): `after_backward`;
- the per-step balancing loop (observe -> plan -> apply): `reduce_stats` turns each layer's local routing
  statistics into global ones (an all-reduce in a distributed run), `after_step` observes them and the
  step's record, plans, applies the plan before the next step and may add fields to the record (it can write
  its own `plans.jsonl` in `trainer.run_dir`);
- anything stateful saves itself in the checkpoint through `state_dict` / `load_state_dict` (JSON), and tensors
  through `extra_tensors` / `read_tensors`.

`on_start`, `before_step`, `after_step`, `on_end` and the state run in every mode of the trainer; `after_backward`
and `reduce_stats` are called by the local step (moebal/train/local.py), whose gradients and routing statistics
they act on. A pipeline is a step strategy (moebal/train/strategy.py), not a hook: its stage balances itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from moebal.routing import RoutingStats
    from moebal.train.checkpoint import CheckpointReader
    from moebal.train.trainer import Trainer

__all__ = ["Hook"]


class Hook:
    """Base class: every method is a no-op, override the ones you need."""

    @property
    def name(self) -> str:
        """Key of this hook's state in a checkpoint."""
        return type(self).__name__

    def on_start(self, trainer: Trainer) -> None:
        """After model, optimizer and data exist and any checkpoint has been loaded."""

    def before_step(self, trainer: Trainer, step: int) -> None:
        """Before step `step` (1-based) reads its batch: apply a plan decided after the previous step."""

    def before_last_micro_batch(self, trainer: Trainer, step: int) -> None:
        """With `train.grad_accum` > 1, before the forward of the step's last micro-batch: arm what sends
        gradients during the backward pass (they are final sums only in the last one)."""

    def after_backward(self, trainer: Trainer, step: int) -> None:
        """Gradients exist and are not yet clipped: synchronise or aggregate them here."""

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        """The step's per-layer routing statistics (local); return the ones every rank should act on."""
        return stats

    def after_step(self, trainer: Trainer, step: int, stats: list[RoutingStats], record: dict[str, Any]) -> None:
        """After the optimizer step, with the step's (reduced) routing statistics (none from a pipeline step)
        and its metrics record."""

    def on_end(self, trainer: Trainer) -> None:
        """After the last step and the final validation."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors saved in checkpoints beside the weights (`CheckpointReader.read_extra`), by names that no
        other rank, hook or strategy writes."""
        return {}

    def read_tensors(self, reader: CheckpointReader) -> None:
        """On resume, on every rank, before anything is applied: read and check this hook's `extra_tensors`
        (collectives allowed; a rank's error must be every rank's). `load_state_dict` installs them."""
