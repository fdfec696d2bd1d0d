"""The micro-batch planner of a pipeline (DynaPipe): the cost table, planning ahead, the plan of each step.

  1. cost table (`MicroBatchCost`, per stage x micro-batch rows x padded length): 'measure' profiles every
     stage at start-up (`pipeline/microbatch_profile.py`, gathered along the chain), a `.json` file is read, a
     hardware profile name gives the analytic table of the current partition (`planner/microbatch_cost.py`);
  2. planning ahead: every rank reads the global batches `lookahead` steps ahead (the samplers are
     deterministic); global rank 0 submits their sample lengths to the planning workers
     (`balance/microbatch_workers.py`), which run the pure DP (`planner/microbatch.py`) and publish the plans
     in step order;
  3. the plan of step s: every rank takes it (the only wait on planning, reported as `plan_wait_s`) with the
     step's samples; `pipeline/planned.py` executes it on the engine.
After the layer balancer migrates layers (`after_migration`) the table is rebuilt for the new partition (a
measured table by profiling the new stages again, collective along the chain) and the batches already read
ahead are planned again with it (a new generation of plans): each batch is planned on the partition that runs
it, so planning ahead in workers splits the batches as planning inline does, and a resume plans them as the
uninterrupted run did. A `.json` table describes the partition it was made for and is kept.

A dynamism scheme changes what its layers cost (pruned or sparse layers, frozen ones without a backward,
tokens that exited or skip a block): each batch is planned on the table's times scaled per stage by the
scheme's latest prediction (`scheme_scale`: the layer balancer's smoothed unit costs without dynamism times
`Dynamism.unit_cost_factors`, `planner/microbatch_cost.py` `stage_scale`), taken when the batch is read ahead.
The activation bytes stay the table's (an upper bound: the schemes save no more than the dense layers). A
checkpoint keeps the scales of the batches read ahead (`plan_scales`), so a resumed run plans them as the
uninterrupted one did.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from moebal.balance.microbatch_workers import PlanAhead
from moebal.config import Config
from moebal.data import ordering_sampler
from moebal.errors import ConfigError
from moebal.planner.microbatch import MicroBatchPlan
from moebal.planner.microbatch_cost import MicroBatchCost, analytic_table, default_grid, load_cost, stage_scale
from moebal.train.precision import compute_precision

if TYPE_CHECKING:
    from moebal.pipeline.runner import PipelineRunner

__all__ = ["MicrobatchPlanner", "planner_kwargs"]


def planner_kwargs(cfg: Config, dp: int, lockstep: int = 1) -> dict[str, Any]:
    """The plan_microbatches arguments of a run (method, memory, thinning, schedules, ...): `dp` independent
    replicas of `lockstep` ranks each (`pipeline/planned.py`, `Lockstep`)."""
    p = cfg.pipeline
    return {"method": p.microbatching, "dp": dp, "lockstep": lockstep, "memory": p.dynamic.memory,
            "max_len": cfg.data.seq_len,
            "pad_multiple": p.dynamic.pad_multiple, "thin": p.dynamic.thin,
            "schedules": tuple(x.strip() for x in p.dynamic.schedules.split(",") if x.strip())}


class _ReadAhead(NamedTuple):
    """A batch read ahead of training: its step, samples, the curriculum's sample ids and sampler position after
    it, and the dynamism scheme's stage scale it is planned with."""

    step: int
    samples: list[np.ndarray]
    ids: list[int]
    at: int
    scale: list[float] | None

    @property
    def lengths(self) -> list[int]:
        """Each sample's (input, label) pairs: what the planner plans."""
        return [len(x) - 1 for x in self.samples]


class MicrobatchPlanner:
    """The plans of the next steps for one rank of a pipeline (module docstring)."""

    def __init__(self, runner: PipelineRunner, *, kwargs: dict[str, Any], cost: MicroBatchCost | None = None,
                 workers: int | None = None) -> None:
        """`kwargs`: the planner's arguments (`planner_kwargs`: the runner's replicas and lockstep ranks)."""
        self.r = runner
        cfg = runner.cfg
        self.kwargs = kwargs
        self.lookahead = cfg.pipeline.dynamic.lookahead
        self._given_cost = cost is not None
        self.cost = cost if cost is not None else self.cost_table()
        n_workers = cfg.pipeline.dynamic.workers if workers is None else workers
        self.ahead = PlanAhead.for_job(self.cost, self.kwargs, n_workers)
        self._batches: collections.deque[_ReadAhead] = collections.deque()
        self._restored: dict[int, list[float] | None] = {}  # a checkpoint's scales of the batches it read ahead
        self._restored_cost: dict[str, Any] | None = None  # a checkpoint's measured table (`restore_cost`)
        self._read = 0
        self._positions: collections.deque[dict[str, Any]] = collections.deque()
        self.batch_ids: list[int] = []
        """The sample ids of the last batch `next` gave, and the sampler position after it (`batch_at`): what
        Adaptive Gating's curriculum records that step's complexities against."""
        self.batch_at = 0
        self.sampler = ordering_sampler(runner.data.train)
        if self.sampler is not None:  # batches are drawn `lookahead` steps before they train (see `_fill`)
            self.sampler.set_curriculum_lag((self.lookahead + 1) * cfg.data.batch_size)

    # ---- costs ----
    def cost_table(self) -> MicroBatchCost:
        """'measure': every rank profiles its own stage, gathered along the chain; a path; a hardware profile."""
        r = self.r
        dyn, d = r.cfg.pipeline.dynamic, r.cfg.data
        max_tokens = r.cfg.microbatch_max_tokens
        b_grid, s_grid = default_grid(d.seq_len, max_tokens)
        if dyn.costs == "measure":
            from moebal.pipeline.microbatch_profile import profile_stage

            f, b, a = profile_stage(r.stage, b_grid, s_grid, max_tokens, device=r.device)
            mine = torch.from_numpy(np.stack([f, b, a]).reshape(-1))
            parts = r.chain.allgather_1d(mine)
            arr = torch.stack(parts).numpy().reshape(r.chain.size, 3, len(b_grid), len(s_grid))
            return MicroBatchCost(b_grid=b_grid, s_grid=s_grid, fwd_PBS=arr[:, 0], bwd_PBS=arr[:, 1],
                                  act_PBS=arr[:, 2], source="measured at start-up",
                                  meta={"sizes": list(r.sizes), "max_tokens": max_tokens})
        if dyn.costs.endswith(".json"):
            table = load_cost(dyn.costs)
            if table.stages != r.chain.size:
                raise ConfigError(f"pipeline.dynamic.costs {dyn.costs} has {table.stages} stages; this pipeline "
                                  f"has {r.chain.size}")
            return table
        from moebal.planner.cost import ModelShape

        return analytic_table(ModelShape.from_config(r.cfg), dyn.costs, list(r.sizes), b_grid, s_grid,
                              compute_precision(r.cfg.train.precision, r.device))

    def after_migration(self) -> None:
        """The layers moved: the table is rebuilt for the new partition (every rank; a measured table profiles
        the new stages, a collective along the chain), and every rank still training starts a new generation
        of plans, in which the planning rank plans the batches read ahead again, on the new table and with the
        scheme's scale of the new partition (`PlanAhead.replan`). So every batch is planned on the partition
        that runs it, whether the workers plan ahead or the step plans inline (`workers: 0`), and a run resumed
        from a checkpoint taken after the migration plans the batches it reads again as the uninterrupted run
        planned them (its checkpoint keeps their scales). After a re-pack the old plans also name stages that
        are gone. The replanned batches' plans may be exposed (the step after a migration waits for them)."""
        repacked = self.cost.stages != self.r.chain.size
        fixed = self._given_cost or self.r.cfg.pipeline.dynamic.costs.endswith(".json")  # not rebuilt here
        if repacked and fixed:
            raise ConfigError(f"a re-pack onto {self.r.chain.size} stages with a micro-batch cost table of "
                              f"{self.cost.stages} stages ({self.r.cfg.pipeline.dynamic.costs}): use "
                              f"pipeline.dynamic.costs measure or a hardware profile, or pipeline.repack false")
        if not fixed:
            self.cost = self._take_restored_cost() or self.cost_table()
        # the batches read ahead, planned again on the new partition (a fixed table too: the scale moved)
        scale = self.scheme_scale()
        self._batches = collections.deque(b._replace(scale=scale) for b in self._batches)
        self.ahead.replan(self.cost, [(b.step, b.lengths) for b in self._batches], scale)

    def scheme_scale(self) -> list[float] | None:
        """Each stage's predicted time under the dynamism scheme over its time without (`stage_scale` of the
        layer balancer's smoothed unit costs, equal ones before the first profile, and the scheme's latest
        factors); None when the scheme predicts no change. Every rank computes the same (the balancer's costs and
        the scheme's state are the job's)."""
        r = self.r
        factors = np.asarray(r.scheme.unit_cost_factors(r.units), dtype=np.float64)
        tracker = r.balancer.tracker
        costs = tracker.layer_costs() if tracker.ready else np.ones(len(factors))
        extras = (tracker.first_extra, tracker.last_extra) if tracker.ready else (0.0, 0.0)
        sizes = [x for x in r.sizes if x > 0]  # after a re-pack the released ranks hold nothing
        if len(sizes) != self.cost.stages:
            return None
        return stage_scale(costs, factors, sizes, *extras)

    def plan_scales(self) -> dict[str, list[float] | None]:
        """The scales the batches read ahead are planned with, by step (what a checkpoint keeps)."""
        return {str(b.step): b.scale for b in self._batches}

    def restore_scales(self, scales: dict[str, list[float] | None]) -> None:
        """A checkpoint's `plan_scales`: the batches it had read ahead are planned with them again."""
        self._restored = {int(s): v for s, v in scales.items()}

    def cost_state(self) -> dict[str, Any] | None:
        """The measured table (what a checkpoint keeps); None when it is not measured: a file or a hardware
        profile gives the same table again. A resumed run plans with the saved table instead of its own
        measurement, so the batches it plans are split as the uninterrupted run split them (a measurement of
        the same stages differs in its last digits, and a plan can follow them)."""
        if self._given_cost or self.r.cfg.pipeline.dynamic.costs != "measure":
            return None
        return self.cost.to_dict()

    def restore_cost(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's `cost_state`: taken once, by the first plan or the resume's migration, when it was
        measured on the partition then in place with this run's grid (the job's state: every rank decides
        alike, so no rank measures alone)."""
        self._restored_cost = state

    def _take_restored_cost(self) -> MicroBatchCost | None:
        state, self._restored_cost = self._restored_cost, None
        if not state:
            return None
        table = MicroBatchCost.from_dict(state, where="the checkpoint's micro-batch cost table")
        same = (table.meta.get("sizes") == list(self.r.sizes) and table.stages == self.cost.stages
                and np.array_equal(table.b_grid, self.cost.b_grid) and np.array_equal(table.s_grid, self.cost.s_grid))
        return table if same else None

    def _scale_of(self, step: int, current: list[float] | None) -> list[float] | None:
        """The scale batch `step` is planned with: the checkpoint's (`restore_scales`) when it has one for this
        many stages (a run resumed on another layout plans with its own), else `current`."""
        saved = self._restored.pop(step, current)
        return saved if saved is None or len(saved) == self.cost.stages else current

    # ---- the plans ----
    def data_state(self) -> dict[str, Any]:
        """The data position of the next step to train (batches read ahead are read again on resume), with the
        curriculum's table as it is now (every trained step's entries)."""
        if not self._positions:
            return self.r.data.train.state_dict()
        state = dict(self._positions[0])
        if self.sampler is not None:  # the positions leave the table out (`_fill`): it is taken now
            state["curriculum"] = self.sampler.curriculum.state_dict()  # type: ignore[union-attr]
        return state

    def _fill(self, step: int) -> None:
        """Read batches up to step + lookahead; the planning rank submits their lengths. The first batch read
        is `step`'s: a resumed run's data position is that of its first step."""
        if self._restored_cost is not None:  # a resume without a migration: the partition is the saved one
            restored = self._take_restored_cost()
            if restored is not None:
                self.cost = restored
                self.ahead.set_cost(restored)
        if not self._batches:
            self._read = max(self._read, step - 1)
        scale: list[float] | None = None
        if self._read < step + self.lookahead:
            scale = self.scheme_scale()
        while self._read < step + self.lookahead:
            self._read += 1
            # where batch _read starts (checkpoints); a curriculum's table is taken when a checkpoint asks
            self._positions.append(self.sampler.state_dict(table=False) if self.sampler is not None
                                   else self.r.data.train.state_dict())
            samples = self.r.data.train.next_samples()
            # the curriculum records each step's complexities against the batch's ids and position
            ids, at = (list(self.sampler.last_ids), self.sampler.position) if self.sampler is not None else ([], 0)
            mine = self._scale_of(self._read, scale)
            batch = _ReadAhead(self._read, samples, ids, at, mine)
            self._batches.append(batch)
            self.ahead.submit(batch.step, batch.lengths, mine)

    def next(self, step: int, replica: int) -> tuple[MicroBatchPlan, list[np.ndarray], int, dict[str, Any]]:
        """The plan of `step`, its samples, their label count, and the step record's planning figures
        (`replica`: the data-parallel replica whose schedule is reported)."""
        self._fill(step)
        batch = self._batches.popleft()
        self.batch_ids, self.batch_at = batch.ids, batch.at
        self._positions.popleft()
        assert batch.step == step, "batches read ahead are out of step"
        plan, wait = self.ahead.get(step)
        count = sum(batch.lengths)
        info = {"plan_wait_s": round(wait, 6), "micro_batches": len(plan.micro_batches),
                "padding_efficiency": round(plan.padding_efficiency, 4),
                "computed_tokens": plan.computed_tokens, "schedule": plan.replicas[replica].schedule,
                "predicted_time_s": round(plan.predicted_time_s, 6), "plan_s": round(plan.meta["plan_s"], 6),
                "plan_scale": batch.scale}
        return plan, batch.samples, count, info

    def close(self) -> None:
        self.ahead.close()
