"""The step strategy: the one thing that differs between the trainer's modes.

`Trainer` (moebal/train/trainer.py) owns everything a run does around its steps, once for every mode:
validation scheduling and its saved RNG state, the time limit, the progress display, `metrics.jsonl`,
`plans.jsonl`, the dashboard, checkpoints (save, resume under any layout, restart), the summary, the exit of a
rank a re-pack released, and hooks (HF export). A `StepStrategy` says how one step trains and what this rank
holds:

  `LocalStep`     (moebal/train/local.py) one process, or data x expert parallelism; hooks add gradient sync
                  and expert balancing;
  `PipelineStep`  (moebal/train/pipelined.py) this rank's pipeline stage (with a dynamism scheme at parallel.pp
                  1, the one stage: `Config.pipelined`), run by `PipelineRunner` or
                  `PlannedPipelineRunner` (layer rebalancing, re-packing, dynamism schemes, planned
                  micro-batches, expert parallelism inside stages).

Checkpoint contract: `module` and `optimizer` are this rank's weights and AdamW state (written and loaded by
logical name, so any layout resumes any other); `rank_state` / `extra_tensors` are what else the strategy
keeps (JSON per rank, and tensors by name); `read_state` checks and reads a checkpoint's strategy state before
anything is applied, `apply_state` installs it once the weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from moebal.routing import RoutingStats
    from moebal.train.checkpoint import CheckpointReader
    from moebal.train.trainer import Trainer

__all__ = ["StepOutput", "StepStrategy"]


@dataclass
class StepOutput:
    """What one trained step reports to the trainer."""

    record: dict[str, Any]
    """The step's metrics line so far (at least "loss"); the trainer adds the step counters and times. A
    strategy may set "tokens", "tokens_per_s" and "step_time_s" itself (a pipeline logs per-step tokens)."""
    tokens: int
    """Label tokens of the step's global batch."""
    stats: list[RoutingStats] = field(default_factory=list)
    """The step's (reduced) routing statistics, for the hooks' `after_step`."""


class StepStrategy(Protocol):
    """How one step trains, validates and checkpoints in one mode (module docstring)."""

    @property
    def module(self) -> torch.nn.Module:
        """This rank's trained module: the model, or its pipeline stage."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer (None: nothing here trains, a fully frozen stage)."""
        ...

    @property
    def released(self) -> bool:
        """This rank left the job (a re-pack released it): it trains, validates and writes nothing more."""
        ...

    def describe(self) -> str:
        """The layout in words, for the start-up line."""
        ...

    def start(self, trainer: Trainer) -> None:
        """Before the first step (after any resume): start-up measurements, collective where needed."""

    def train_step(self, trainer: Trainer, step: int) -> StepOutput:
        """Read the step's batch, set the learning rate, forward, backward, synchronise, clip, step."""
        ...

    def routing_sample(self, trainer: Trainer, step: int) -> torch.Tensor | None:
        """On the main rank, after a step that records its routing (`train.record_routing_every`): every MoE
        layer's top-k expert ids of the step's last micro-batch on the first data rank's tokens, int64 [L, T, K]
        in model order; None on the other ranks. Local (no collective): a pipeline gathers it inside the step."""
        ...

    def evaluate(self, trainer: Trainer) -> tuple[float, float]:
        """Forward-only summed token loss and label count over `trainer.data.val`, the same on every rank
        still training (the trainer keeps the RNG state around it)."""
        ...

    def agree_any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank still training (the time limit stops every rank at one step)."""
        ...

    def barrier(self) -> None:
        """Wait for every rank still training."""

    def layout(self) -> dict[str, Any]:
        """The parallel layout a checkpoint records (a resume under another one reshards)."""
        ...

    def writing_ranks(self) -> list[int]:
        """Ranks that write the next checkpoint (all, or those still training)."""
        ...

    def data_state(self) -> dict[str, Any]:
        """The data position of the next step to train."""
        ...

    def rank_state(self) -> dict[str, Any]:
        """This rank's JSON state beyond RNG and hooks."""
        ...

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors beyond weights and optimizer state, by checkpoint name (this rank's share)."""
        ...

    def saved_rank(self, state: dict[str, Any]) -> str:
        """The saved rank whose per-rank state (RNG, hooks) this rank continues in checkpoint `state`."""
        ...

    def read_state(self, reader: CheckpointReader) -> None:
        """Read and check the checkpoint's strategy state on every rank; nothing is applied yet."""

    def apply_state(self, reader: CheckpointReader) -> None:
        """Install what `read_state` read, after the weights, optimizer state and step are loaded."""

    def settle_kernels(self, trainer: Trainer, recorded: dict[str, Any] | None) -> dict[str, Any] | None:
        """The run's expert kernel record (moebal/train/kernels.py), or None where the strategy keeps the
        configured kernels."""
        ...

    def new_plans(self) -> list[dict[str, Any]]:
        """Plans made since the last call, for `plans.jsonl` (a strategy whose hooks write it returns [])."""
        ...

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """Mode-specific fields of `summary.json`."""
        ...

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """Mode-specific lines of the printed summary."""
        ...

    def finish(self, trainer: Trainer) -> None:
        """After the last step, on the writing rank: mode-specific plots."""

    def close(self) -> None:
        """Release communication resources."""
