"""Bad steps: a loss or gradient norm that is not finite, or a loss spike, and what the run does about them.

`train.spike.action: stop` ends the run at the bad step (its checkpoints untouched). `rollback` is PaLM's
recovery (Chowdhery et al. 2022, section 5.1: restart from a checkpoint before the spike and skip the data
batches around it): the trainer goes back to the run's newest checkpoint (or the newest at least `back` steps
before the bad step) and skips the batches trained since it, plus `skip_extra` more. Each rollback is one line
of `rollbacks.jsonl` in the run directory, written by rank 0 before any rank reloads:

    {"step": 57, "reason": "...", "loss": 9.1, "grad_norm": 3.2, "resume_step": 50, "skipped_batches": 7,
     "skip_extra": 0, "data": {...}, "time": 1796262000.0}

`data` is the data loader's position after the bad step (the strategy's `data_state`, which counts batches a
pipeline has read ahead as unread) and `skip_extra` the batches to draw past it. A resume from checkpoint
`resume_step` (the in-process reload after the rollback, or any later restart from that checkpoint before
the run has written a newer one) takes the newest such line's position instead of the checkpoint's, so a
crash after a rollback does not train the skipped batches again. A checkpoint written after the rollback
holds the skipped position itself.

`MOEBAL_INJECT_SPIKE=STEP[:SCALE]` makes a real spike to test the recovery on (`InjectedSpike`): every weight
of every rank's model is scaled by SCALE (30) before step STEP, unless the run directory already records a
rollback from that step (so the rolled-back run, and any restart after it, train on without it).

A spike is a finite loss above `factor` times the median of the previous `window` steps' losses, or (with
`grad_factor`) a gradient norm, before clipping, above `grad_factor` times the median of their norms (figures
every rank already holds, reduced, so every rank calls the same step bad at no extra cost). The histories are
part of the checkpoint, so a resumed run calls the same steps bad as the uninterrupted one. A bad step's figures
do not enter them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from moebal.config import SpikeConfig
from moebal.errors import CheckpointError, ConfigError, DataError, TrainingError
from moebal.fileio import complete_lines
from moebal.train.hooks import Hook

if TYPE_CHECKING:
    from moebal.distributed.groups import ParallelDims
    from moebal.train.trainer import Trainer

T = TypeVar("T")

__all__ = ["INJECT_ENV", "ROLLBACKS", "InjectedSpike", "Rollback", "append_rollback", "bad_step", "injected_spike",
           "read_rollbacks", "remember", "replay_spikes", "rollback_for", "train_with_rollbacks"]

ROLLBACKS = "rollbacks.jsonl"
INJECT_ENV = "MOEBAL_INJECT_SPIKE"


class InjectedSpike(Hook):
    """A real loss spike (a fault injected to test the recovery, `MOEBAL_INJECT_SPIKE=STEP[:SCALE]`): every weight
    of the rank's model scaled by `scale` before step `step`, on every rank alike. Not again once the run
    directory records a rollback from that step: the rolled-back run trains on, and so does a restart or a resume
    after it, as a transient fault would leave them. Its state is the run directory's, so the hook adds nothing to
    a checkpoint, and a run resumed without it (a reference) loads the same checkpoint. Weights sharded at rest
    are gathered for the write, as a checkpoint load writes them."""

    name = "injected_spike"

    def __init__(self, step: int, scale: float = 30.0) -> None:
        self.step, self.scale = step, scale

    def before_step(self, trainer: Trainer, step: int) -> None:
        if step != self.step or any(int(r.get("step", -1)) == step for r in trainer.rollbacks):
            return
        import torch

        from moebal.distributed.sharded import weights_gathered

        # expert weights sharded at rest (`shard: full`, docs/sharding.md) are freed between steps: gathered for
        # the write, and their owned parts take the scaled values (collective over "dp", every rank here alike)
        with torch.no_grad(), weights_gathered(trainer.optimizer, write=True):
            for p in trainer.model.parameters():
                p.mul_(self.scale)


def injected_spike(environ: dict[str, str] | None = None) -> InjectedSpike | None:
    """The spike `MOEBAL_INJECT_SPIKE` asks for (None when it is unset or empty); a `ConfigError` names a value
    that is not STEP or STEP:SCALE (a step of at least 1, a finite scale above 1)."""
    raw = (os.environ if environ is None else environ).get(INJECT_ENV, "").strip()
    if not raw:
        return None
    step_text, _, scale_text = raw.partition(":")
    try:
        step, scale = int(step_text), float(scale_text) if scale_text else 30.0
    except ValueError:
        step, scale = 0, 0.0
    if step < 1 or not (math.isfinite(scale) and scale > 1):
        raise ConfigError(f"{INJECT_ENV}={raw!r}: expected STEP or STEP:SCALE, a step of at least 1 and a scale "
                          f"above 1 (every weight is multiplied by it before that step), e.g. {INJECT_ENV}=5 or "
                          f"{INJECT_ENV}=5:30; unset it to train without the fault")
    return InjectedSpike(step, scale)


class Rollback(TrainingError):
    """The run went back to a checkpoint: build the trainer again from `record["resume_step"]` (what `moebal
    train` does) to continue past the skipped batches."""

    def __init__(self, message: str, record: dict[str, Any], checkpoint: Path) -> None:
        super().__init__(message)
        self.record, self.checkpoint = record, checkpoint


def bad_step(loss: float | None, grad_norm: float | None, history: list[float],
             spike: SpikeConfig, norms: list[float] | None = None) -> tuple[str, str] | None:
    """Whether a step is bad: ("diverged", why) for a loss or gradient norm that is not finite, ("spiked", why)
    for a loss above `spike.factor` times the median of the last `spike.window` losses of `history`, or a
    gradient norm above `spike.grad_factor` times the median of the last `spike.window` norms of `norms`, else
    None."""
    if not all(math.isfinite(x) for x in (loss or 0.0, grad_norm or 0.0)):
        return "diverged", f"the loss is {loss} and the gradient norm {grad_norm}"
    for what, value, factor, key, past in (("loss", loss, spike.factor, "factor", history),
                                           ("gradient norm", grad_norm, spike.grad_factor, "grad_factor", norms)):
        if factor and value is not None and past is not None and len(past) >= spike.window:
            median = statistics.median(past[-spike.window:])
            if value > factor * median:
                return "spiked", (f"the {what} {value:.4g} is {value / median:.2f}x the median {median:.4g} of the "
                                  f"previous {spike.window} steps (train.spike.{key} {factor})")
    return None


def replay_spikes(records: list[dict[str, Any]], spike: SpikeConfig) -> list[tuple[int, str, str]]:
    """The steps of a run's metrics lines (`metrics.jsonl`, oldest first) that `spike`'s tests call bad, as
    (step, kind, why): the trainer's own test (`bad_step`) over the same histories, a bad step's figures kept out
    of them, as if the run had gone on past every bad step as it did (choosing `train.spike.factor` and
    `grad_factor` on a finished run: `scripts/spike_replay.py`). Every step must have its line
    (`train.log_every=1`, the default); a `DataError` names the first gap."""
    steps = [int(r["step"]) for r in records]
    for a, b in zip(steps, steps[1:]):
        if b != a + 1:
            raise DataError(f"the metrics lines go from step {a} to step {b}: a replay needs every step's line "
                            f"(train.log_every=1, the default)")
    loss_hist: list[float] = []
    norm_hist: list[float] = []
    out = []
    for r in records:
        loss, norm = r.get("loss"), r.get("grad_norm")
        bad = bad_step(loss, norm, loss_hist, spike, norm_hist)
        if bad is not None:
            out.append((int(r["step"]), *bad))
            continue
        loss_hist, norm_hist = remember(loss_hist, loss, spike.window), remember(norm_hist, norm, spike.window)
    return out


def remember(history: list[float], value: float | None, window: int) -> list[float]:
    """A spike test's history after a good step: its last `window` figures with `value` (when the step has one)
    added; the trainer's rule and a replay's."""
    return history if value is None else (history + [float(value)])[-window:]


def read_rollbacks(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's rollback records, oldest first ([] when it has none)."""
    path = Path(run_dir) / ROLLBACKS
    if not path.is_file():
        return []
    out = []
    # a record cut off before its newline (a crash while appending) is no record: its batches are retrained
    for n, line in enumerate(complete_lines(path.read_text(encoding="utf-8")), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            int(rec["resume_step"]), int(rec["skip_extra"]), dict(rec["data"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} line {n} is not a rollback record ({e}): the run's skipped batches "
                                  f"cannot be known; restore the file, or delete the line to train them "
                                  f"again") from None
        out.append(rec)
    return out


def rollback_for(records: list[dict[str, Any]], step: int) -> dict[str, Any] | None:
    """The newest rollback to checkpoint `step`: its data position replaces the checkpoint's on resume."""
    mine = [r for r in records if int(r["resume_step"]) == step]
    return mine[-1] if mine else None


def append_rollback(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Add one record to the run's `rollbacks.jsonl`, on disk before this returns (a crash right after the
    rollback must still skip the batches)."""
    path = Path(run_dir) / ROLLBACKS
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def train_with_rollbacks(trainer: Trainer, rebuild: Callable[[Path, ParallelDims | None], Trainer],
                         run: Callable[[Trainer], T]) -> T:
    """`run(trainer)`; after a `Rollback` (raised on every rank at the same step) the trainer is released and
    `rebuild(checkpoint, dims)` builds the next one from the checkpoint over the same process groups (`dims`,
    None in one process), as often as the run rolls back. The last trainer is closed on the way out, its
    communication scheduler left to the process's exit as before rollbacks existed (closing it after a failed
    collective, a peer rank killed, aborted a rank now and then: `tests/integration/test_launch_netns.py`); the
    process groups stay with the caller."""
    live = True  # `trainer` holds resources (false while a rebuild is on its way)
    try:
        while True:
            try:
                return run(trainer)
            except Rollback as e:
                if trainer.ctx.is_main:
                    sys.stderr.write(f"moebal train: {e}\n")
                    sys.stderr.flush()
                started, dims = trainer.created, trainer.ctx.dims if trainer.ctx.distributed else None
                _release(trainer)
                live = False
                trainer = rebuild(e.checkpoint, dims)
                live = True
                trainer.created = started  # train.time_limit_min counts from start-up
    finally:
        if live:  # the way out, maybe after a failed collective: as a run without rollbacks leaves, the
            trainer.close()  # communication scheduler's thread is left to the process's exit


def _release(trainer: Trainer) -> None:
    """Between a rollback and the rebuild (every rank healthy, nothing in flight): the trainer's strategy and its
    communication scheduler (not the process groups)."""
    trainer.close()
    if trainer.ctx.comm is not None:
        trainer.ctx.comm.close()
        trainer.ctx.comm = None
