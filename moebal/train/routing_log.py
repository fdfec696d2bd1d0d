"""Routing samples of a training run: the input of Lina's path profile (moebal/planner/paths.py).

`RoutingRecorder` (a trainer hook, on with `train.record_routing_every: N`) writes, every N steps, the routing of
the step's last micro-batch: every MoE layer's top-k expert ids of each of rank 0's tokens (its data shard),
on rank 0 only, to `<run dir>/routing/step_NNNNNN.npz` (one int16 array `ids_LTK`, L MoE layers in model order,
T tokens, K = top_k, the gate's order: column 0 is the first choice). `load_routing(run_dir)` reads them back in
step order. The step strategy provides the sample (`StepStrategy.routing_sample`): the model's layers on one
process or under data x expert parallelism; in a pipeline each stage's layers, gathered along rank 0's chain
inside the step before any migration (`PipelineRunner._gather_routing`; on planned micro-batches the real tokens
of the micro-batch every stage forwards last, so T varies from sample to sample).

Shape legend: L MoE layers, T tokens, K = top_k.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moebal.sync import to_host
from moebal.train.hooks import Hook

if TYPE_CHECKING:
    from moebal.routing import RoutingStats
    from moebal.train.trainer import Trainer

__all__ = ["RoutingRecorder", "cut_routing", "load_routing", "routing_files"]

ROUTING_DIR = "routing"


class RoutingRecorder(Hook):
    """Writes the step's routing every `every` steps (rank 0; the host read happens only on those steps)."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"RoutingRecorder: every must be >= 1; got {every}")
        self.every = every

    def after_step(self, trainer: Trainer, step: int, stats: list[RoutingStats], record: dict[str, Any]) -> None:
        if step % self.every:
            return
        ids_LTK = trainer.strategy.routing_sample(trainer, step)  # main rank only (a pipeline's: gathered)
        if ids_LTK is None:
            return
        sample = np.asarray(to_host(ids_LTK, "routing sample"), dtype=np.int16)
        out = Path(trainer.run_dir) / ROUTING_DIR
        out.mkdir(parents=True, exist_ok=True)
        # whole or not at all: written beside its name (hidden from `routing_files`), then renamed into place
        tmp = out / f".step_{step:06d}.npz.tmp"
        with open(tmp, "wb") as f:
            np.savez_compressed(f, ids_LTK=sample)
        os.replace(tmp, out / f"step_{step:06d}.npz")


def cut_routing(run_dir: str | Path, step: int) -> None:
    """Delete the routing samples of steps after `step` (a resumed run records its own; one that stops earlier,
    or records at another interval, would leave the discarded run's beside them)."""
    for path in (Path(run_dir) / ROUTING_DIR).glob("step_*.npz"):
        if _step_of(path)[0] > step:
            path.unlink(missing_ok=True)


def _step_of(path: Path) -> tuple[int, str]:
    digits = path.name.removeprefix("step_").removesuffix(".npz")
    return (int(digits), path.name) if digits.isdigit() else (-1, path.name)


def routing_files(run_dir: str | Path) -> list[Path]:
    """The run's routing samples in step order (raises naming the fix when there are none)."""
    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir} is not a directory: give the run directory of a `moebal train` run")
    # by step number: the names' zero padding ends at step 999,999, after which they no longer sort as text
    files = sorted((Path(run_dir) / ROUTING_DIR).glob("step_*.npz"), key=_step_of)
    if not files:
        raise ValueError(f"no routing samples in {Path(run_dir) / ROUTING_DIR}: train with "
                         f"train.record_routing_every=N (e.g. 10) to record them")
    return files


def load_routing(run_dir: str | Path) -> list[np.ndarray]:
    """Every routing sample of a run as an int64 [L, T, K] array, in step order (a file that is not one raises
    ValueError naming it)."""
    samples = []
    for f in routing_files(run_dir):
        try:
            with np.load(f) as data:
                ids = np.asarray(data["ids_LTK"])
        except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise ValueError(f"{f} is not a routing sample ({type(e).__name__}: {e}): delete it, or record the "
                             "routing again") from None
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{f} is not a routing sample (ids_LTK of shape {ids.shape}, {ids.dtype}; expected "
                             "integer expert ids, layers x tokens x top_k): delete it, or record the routing again")
        samples.append(ids.astype(np.int64))
    return samples
