"""The layer balancer of a pipeline: observe per-unit costs, plan a stage partition (or a re-pack), migrate, check.

At each plan point (every `pipeline.every` steps, or every step when the dynamism scheme re-plans each step),
every rank of the job runs the same sequence on the same all-reduced numbers, so every rank decides alike:
  1. observe (profiled iterations): per-unit forward, backward and weight-gradient seconds, activation and
     static bytes; the maximum over expert shards (the all-to-alls wait for the slowest), the mean over
     data-parallel replicas, the sum along the chain; smoothed by `CostTracker` and scaled to wall seconds by
     the contention factor kappa (`pipeline/observe.py`);
  2. plan: the pure partitioner (`planner/partition.py`: exact min-max by time, or diffusion) under memory
     caps; the adoption rule (predicted gain over the next interval above the migration cost, `should_adopt`,
     then the hysteresis `clears_hysteresis`); then a re-pack onto fewer stages (`plan_repack`);
  3. apply: migrate units with gradients and optimizer state (`pipeline/migrate.py`) on every rank;
  4. check (`balance/feedback.py`, `pipeline.feedback`): an adopted partition runs a trial of `window`
     iterations; when its median measured iteration is slower than the partition it replaced (beyond
     `tolerance`), the balancer migrates back and adopts nothing for a hold that doubles after each failure.
     Forced partitions and re-packs are orders, not trials: they replace both arms.
Each plan and each verdict is appended to `plans` (the run's `plans.jsonl`), each migration to the step's record.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.balance.feedback import FeedbackConfig, PlanFeedback
from moebal.distributed.probe import probe_link
from moebal.errors import ConfigError
from moebal.pipeline.engine import IterationResult
from moebal.pipeline.migrate import MigrationReport, migrate_layers
from moebal.pipeline.observe import CostTracker, LayerProfiler, static_bytes, transfer_bytes
from moebal.planner.partition import (
    StagePartition,
    clears_hysteresis,
    diffuse,
    imbalance,
    partition_by_time,
    plan_repack,
    replay_time,
    should_adopt,
    stage_loads,
)
from moebal.planner.schedule import in_flight

if TYPE_CHECKING:
    from moebal.pipeline.runner import PipelineRunner

__all__ = ["LayerBalancer", "expand_repack"]

ORDERS = ("forced", "forced-mid", "repack")
"""Migrations that replace both arms of the feedback loop (a trial in progress is dropped). The planner's
partitions are trialled; a resume restores the partition the loop's saved state describes."""


def expand_repack(sizes: Sequence[int], chain_size: int) -> list[int]:
    """A P'-stage partition laid over a P-rank chain: the first P' - 1 ranks and the last keep stages (the
    embedding stays on the first rank, the head on the last), the middle ranks in between get 0 layers."""
    k = len(sizes)
    if k > chain_size or k < 1:
        raise ConfigError(f"partition {list(sizes)} has more stages than the {chain_size} ranks of the pipeline")
    if min(sizes[0], sizes[-1]) < 1 or min(sizes) < 0:
        raise ConfigError(f"partition {list(sizes)}: the first and last stages hold the embedding and the head and "
                          f"need a layer each, and no stage holds fewer than 0")
    if k == chain_size:
        return list(sizes)
    if k == 1:
        raise ConfigError("re-packing onto one stage is not supported: the embedding and the head stay on two ranks")
    return list(sizes[:-1]) + [0] * (chain_size - k) + [sizes[-1]]


class LayerBalancer:
    """Observe, plan, apply and check at the layer granularity for one rank of a pipeline (module docstring).

    The runner owns the stage, the chain, the optimizer and the current partition (`runner.sizes`); the balancer
    changes them only through a migration (`apply`)."""

    def __init__(self, runner: PipelineRunner, feedback: FeedbackConfig | None = None,
                 bandwidth: float | None = None) -> None:
        self.r = runner
        self.opts = runner.opts
        self.U = runner.U
        self.tracker = CostTracker(self.U, ema=self.opts.ema)
        self.kappa: float | None = None
        self.bandwidth: float | None = bandwidth
        self.comm_s = 0.0
        self.static_mem = np.zeros(self.U + 2)
        self.move_bytes = np.zeros(self.U + 2)
        self.plans: list[dict[str, Any]] = []
        self.gantt: dict[str, list[list[float]]] = {}
        self._want_after_gantt = False
        self._proposed: tuple[tuple[int, ...], int] | None = None
        """The last plan point's proposal that gained more than it costs, and at how many consecutive points."""
        self.feedback = PlanFeedback(feedback or FeedbackConfig(enabled=True), auto=False)
        self.trial: dict[str, Any] | None = None
        """The adopted partition under trial: its sizes, the partition it replaced, the step and the prediction."""

    # ---- when ----
    @property
    def planning(self) -> bool:
        return self.opts.rebalance != "off" or self.opts.repack

    def profiled(self, step: int) -> bool:
        return self.planning and step % self.opts.every == 0

    def profiler(self) -> LayerProfiler:
        return LayerProfiler(self.U, self.r.clock, count_bytes=self.opts.memory_cap is not None)

    def _num_micro(self) -> int:
        return self.r._num_micro()

    def start(self) -> None:
        """Measure the links when planning needs them (collective along the chain)."""
        if self.planning and self.bandwidth is None:
            self._measure_links()
        self.bandwidth = self.bandwidth or 1e9

    # ---- the step ----
    def step(self, step: int, res: IterationResult, red: dict[str, Any], factors: np.ndarray,
             profiled: bool) -> dict[str, Any]:
        """After the optimizer step: check the partition under trial, observe, plan and apply; the step's events."""
        if profiled:  # first: a revert below changes the slots this rank owns
            self.observe(res, factors)
        events = self._check(step, red)
        # no new plan on a step that judged a trial: a revert has just moved layers back, and a kept partition has
        # just been confirmed against its own measured time (the next plan point plans from it)
        events.update(self.plan_and_apply(step, res, plan=not events))
        if self._want_after_gantt and not events.get("adopted"):
            self.keep_gantt("after", res)
            self._want_after_gantt = False
        return events

    # ---- observe ----
    def _measure_links(self) -> None:
        """Latency and bandwidth between chain neighbours (`moebal.distributed.probe`): round trips of a 4 KiB
        and a 4 MiB message (median of 3 each), averaged over the pipelines' non-last stages; an activation
        transfer and a layer migration are then costed as latency + bytes/bandwidth."""
        r, chain = self.r, self.r.chain
        last = chain.is_last

        def round_trip(t: torch.Tensor) -> None:
            if not chain.is_last:
                chain.send(t, chain.next)
            if not chain.is_first:
                chain.recv(t, chain.prev)
                chain.send(t, chain.prev)
            if not chain.is_last:
                chain.recv(t, chain.next)
            chain.flush()

        def agree(t: torch.Tensor) -> torch.Tensor:  # every pipeline must plan from the same numbers
            v = torch.zeros(3, dtype=torch.float64) if last else torch.cat([t.cpu(), torch.ones(1, dtype=t.dtype)])
            tot = chain.allreduce_sum(r._stage_mean(v))
            return tot[:2] / max(float(tot[2]), 1.0)

        link = probe_link(round_trip, r.device, sizes=(4096, 4 << 20), repeats=3, legs=2, agree=agree)
        self.bandwidth = link.bandwidth
        B = max(1, r.cfg.data.batch_size // r.data_ranks // self.opts.micro_batches)
        self.comm_s = link.seconds(B * r.cfg.data.seq_len * r.cfg.model.dim * 4)

    def observe(self, res: IterationResult, factors: np.ndarray) -> None:
        """Fold the profiled iteration into the smoothed costs (identical on every rank afterwards)."""
        r = self.r
        assert r.engine.profiler is not None
        prof = r.engine.profiler.result(r.engine.owned_slots())
        owned = prof.fwd >= 0
        L2 = self.U + 2
        vec = torch.zeros(6 * L2 + 2, dtype=torch.float64)
        vec[:L2] = torch.from_numpy(np.where(owned, prof.fwd, 0.0))
        vec[L2:2 * L2] = torch.from_numpy(np.where(owned, prof.bwd, 0.0))
        vec[2 * L2:3 * L2] = torch.from_numpy(np.where(owned, prof.act_bytes, 0.0))
        for slot, m in r.stage.slot_modules().items():
            vec[3 * L2 + slot] = static_bytes(m, r.optimizer)
            vec[4 * L2 + slot] = transfer_bytes(m, r.optimizer)
        vec[5 * L2:6 * L2] = torch.from_numpy(np.where(owned, prof.wgt, 0.0))
        vec[6 * L2], vec[6 * L2 + 1] = res.busy_s, res.busy_cpu_s
        if r.experts.sharded:  # a stage is as slow as its slowest expert shard (the all-to-alls wait for it)
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=r.ep_group)
        if r.dp > 1:  # replicas must plan from the same numbers: average their profiles first
            dist.all_reduce(vec, group=r.dp_group)
            vec /= r.dp
        tot = r.chain.allreduce_sum(vec).numpy()
        self.tracker.update(tot[:L2], tot[L2:2 * L2], tot[2 * L2:3 * L2], factors, wgt=tot[5 * L2:6 * L2])
        self.static_mem = tot[3 * L2:4 * L2]
        self.move_bytes = tot[4 * L2:5 * L2]
        kappa = float(tot[6 * L2] / tot[6 * L2 + 1]) if tot[6 * L2 + 1] > 0 else 1.0
        if r.clock is time.perf_counter or r.device.type == "cuda":
            kappa = 1.0  # costs are already wall seconds
        self.kappa = kappa if self.kappa is None else (1 - self.opts.ema) * self.kappa + self.opts.ema * kappa

    def iteration_time(self, red: dict[str, Any]) -> float:
        """The measured iteration the feedback loop compares: the slowest stage's engine run, the maximum over
        every pipeline of the job (every rank must feed the loop the same number)."""
        t = torch.tensor([max(red["run"]) if red["run"] else 0.0], dtype=torch.float64)
        if self.r.data_ranks > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.r.stage_group)
        return float(t[0])

    # ---- check ----
    def _check(self, step: int, red: dict[str, Any]) -> dict[str, Any]:
        """Feed the loop this step's measured time; judge a finished trial (a back-off migrates back)."""
        if not (self.feedback.cfg.enabled and self.opts.rebalance != "off"):
            return {}
        self.feedback.observe(step, self.iteration_time(red))
        events: dict[str, Any] = {}
        for verdict in self.feedback.drain():
            trial, self.trial = self.trial, None
            if trial is None:  # programmer invariant: the loop judges only trials the balancer started
                continue
            back = verdict["verdict"] == "backed_off"
            plan = StagePartition(
                sizes=tuple(trial["from"] if back else trial["sizes"]), ranks=tuple(self.r.chain.ranks), step=step,
                balancer="feedback", predicted_time_s=trial["predicted_time_s"],
                previous_time_s=trial["previous_time_s"],
                meta={**verdict, "action": "reverted" if back else "kept", "trial_sizes": list(trial["sizes"]),
                      "adopted_at": trial["step"], "predicted_gain": trial["predicted_gain"]})
            self.plans.append(plan.to_dict())
            events["feedback"] = plan.to_dict()
            if back:
                events.update(self.apply(list(trial["from"]), "feedback-revert", step))
        return events

    # ---- plan and apply ----
    def memory(self) -> tuple[np.ndarray, float, float]:
        """Per-unit bytes on a stage: static bytes + activation bytes x the most micro-batches in flight on
        any stage (stage 0 under 1F1B): a conservative single number per unit, so the partitioner's caps
        hold wherever the unit lands."""
        M = self._num_micro()
        flight = in_flight(self.opts.schedule, self.r.chain.size, 0, M)
        mem = self.static_mem + self.tracker.act_bytes * flight
        return mem[:self.U], float(mem[self.U]), float(mem[self.U + 1])

    def plan_and_apply(self, step: int, res: IterationResult, plan: bool = True) -> dict[str, Any]:
        """Forced partitions of this step, else (at a plan point, when `plan`) the planner's partition and a
        re-pack."""
        events: dict[str, Any] = {}
        for s, sizes in self.r.force:
            if s == step:
                self.keep_gantt("before", res)
                events.update(self.apply(list(sizes), "forced", step))
                events["adopted"] = True
        replan = self.profiled(step) or (self.planning and self.r.scheme.replan_every_step)
        if not (plan and replan and self.tracker.ready) or events:
            return events
        proposal = self.propose(step)
        if proposal is not None:
            self.plans.append(proposal.to_dict())
            if proposal.meta.get("adopt"):
                self.keep_gantt("before", res)
                events.update(self.apply(list(proposal.sizes), proposal.balancer, step))
                events["adopted"] = True
                events["plan"] = proposal.to_dict()
                self._begin_trial(step, proposal)
        if self.opts.repack and self.r.released_at is None and self.r.chain.size > self.opts.min_stages:
            packed = self.propose_repack(step)
            if packed is not None:
                self.plans.append(packed.to_dict())
                if "adopted" not in events:
                    self.keep_gantt("before", res)
                events.update(self.apply(list(packed.sizes), "repack", step))
                events["adopted"] = True
                events["repack"] = packed.to_dict()
        return events

    def _begin_trial(self, step: int, plan: StagePartition) -> None:
        if not self.feedback.cfg.enabled:
            return
        prev, pred = plan.previous_time_s or 0.0, plan.predicted_time_s or 0.0
        self.trial = {"sizes": list(plan.sizes), "from": list(plan.meta["from"]), "step": step,
                      "predicted_time_s": pred, "previous_time_s": prev,
                      "predicted_gain": round(1.0 - pred / prev, 4) if prev > 0 else 0.0}
        self.feedback.begin_trial(step)

    def loads_kw(self) -> dict[str, float]:
        k = self.kappa or 1.0
        return {"first_extra": self.tracker.first_extra * k, "last_extra": self.tracker.last_extra * k}

    def time_fn(self, costs: np.ndarray) -> Callable[[Sequence[int]], float]:
        """Predicted iteration time of a partition (a list of sizes over the current chain): the schedule replayed
        op by op (`replay_time`) with each stage's forward and backward seconds per micro-batch. A slot's cost
        splits into the two by its smoothed measured shares (a frozen layer is all forward; a slot never
        measured takes DynMo's 1 : 2). Under the zero-bubble schedule a stage's backward splits into B and W by
        the W time its slots measured (`CostTracker.wgt`), not by the nominal `W_SHARE`."""
        tr, k, M = self.tracker, self.kappa or 1.0, self._num_micro()
        tot = tr.fwd + tr.bwd
        share = np.divide(tr.fwd, tot, out=np.full(tot.shape, 1.0 / 3.0), where=tot > 0)
        U = self.U
        fwd_c, bwd_c = costs * share[:U], costs * (1.0 - share[:U])
        w_of_b = np.divide(tr.wgt, tr.bwd, out=np.zeros(tot.shape), where=tr.bwd > 0)
        wgt_c = bwd_c * w_of_b[:U]
        extra_f = [tr.fwd[U] * k, tr.fwd[U + 1] * k]
        extra_b = [tr.bwd[U] * k, tr.bwd[U + 1] * k]
        extra_w = [tr.wgt[U] * k, tr.wgt[U + 1] * k]

        @functools.cache  # the planner asks for the same partitions more than once per plan point
        def replay(sizes: tuple[int, ...]) -> float:
            f = stage_loads(fwd_c, sizes, extra_f[0], extra_f[1])
            b = stage_loads(bwd_c, sizes, extra_b[0], extra_b[1])
            w = stage_loads(wgt_c, sizes, extra_w[0], extra_w[1])
            w_share = [min(wi / bi, 1.0) if bi > 0 else 0.0 for wi, bi in zip(w, b)]
            return float(replay_time(f, b, M, float(self.comm_s), self.opts.schedule, w_share))

        return lambda sizes: replay(tuple(int(x) for x in sizes))

    def factors(self) -> np.ndarray:
        """The scheme's latest cost prediction per unit (`Dynamism.unit_cost_factors`)."""
        return np.asarray(self.r.scheme.unit_cost_factors(self.r.units))

    def costs(self) -> np.ndarray:
        """Smoothed per-unit costs in wall seconds (CPU time x the contention factor kappa), scaled by the
        scheme's latest prediction (`CostTracker`)."""
        return self.tracker.layer_costs(self.factors()) * (self.kappa or 1.0)

    def _partition(self, costs: np.ndarray, sizes: list[int]) -> list[int]:
        """The partitioner's proposal under the memory caps (the current partition when nothing fits)."""
        mem, first_mem, last_mem = self.memory()
        cap, kw = self.opts.memory_cap, self.loads_kw()
        if self.opts.rebalance == "partition":
            try:
                return list(partition_by_time(costs, self.r.chain.size, memory=mem, capacity=cap,
                                              first_memory=first_mem, last_memory=last_mem,
                                              current=sizes if len(sizes) == self.r.chain.size else None, **kw))
            except ConfigError:
                return list(sizes)  # nothing fits the caps: keep the current partition
        return list(diffuse(costs, sizes, memory=mem, capacity=cap, first_extra=kw["first_extra"],
                            last_extra=kw["last_extra"], first_memory=first_mem, last_memory=last_mem))

    def propose(self, step: int) -> StagePartition | None:
        """The planner's partition and whether to adopt it (gain over migration cost, hysteresis, the
        feedback loop's trial or hold)."""
        if self.opts.rebalance == "off":
            return None
        sizes, costs, kw = list(self.r.sizes), self.costs(), self.loads_kw()
        proposal = self._partition(costs, sizes)
        t_iter = self.time_fn(costs)
        adopt, gain, cost = should_adopt(costs, sizes, proposal, self._num_micro(), self.opts.every,
                                         self.move_bytes[:self.U], float(self.bandwidth or 1e9), self.r.latency,
                                         time_fn=t_iter)
        t_cur, t_new = t_iter(sizes), t_iter(proposal)
        prev = self._proposed
        streak = (prev[1] + 1 if prev is not None and prev[0] == tuple(proposal) else 1) if adopt else 0
        self._proposed = (tuple(proposal), streak) if adopt else None
        adopt = adopt and clears_hysteresis(t_cur, t_new, self.opts.min_gain, streak, self.opts.confirm,
                                            self.r.cfg.pipeline.confirm_fraction)
        held = adopt and not self.feedback.can_try(step)
        adopt = adopt and not held
        if adopt:
            self._proposed = None
        return StagePartition(
            sizes=tuple(proposal), ranks=tuple(self.r.chain.ranks), step=step, balancer=self.opts.rebalance,
            predicted_time_s=t_new, previous_time_s=t_cur, gain_s=gain, migration_cost_s=cost,
            meta={"adopt": adopt, "from": sizes, "streak": streak, **({"held": True} if held else {}),
                  "imbalance_before": imbalance(stage_loads(costs, sizes, **kw)),
                  "imbalance_after": imbalance(stage_loads(costs, proposal, **kw)),
                  "costs": [round(float(c), 6) for c in costs], "kappa": round(self.kappa or 1.0, 4),
                  "bandwidth": float(self.bandwidth or 0.0), **{k: round(v, 6) for k, v in kw.items()}})

    def propose_repack(self, step: int) -> StagePartition | None:
        """A partition onto fewer stages that the model predicts within `repack_slack` of the current one."""
        costs = self.costs()
        mem, first_mem, last_mem = self.memory()
        t_iter = self.time_fn(costs)
        chain = self.r.chain
        sizes = plan_repack(costs, chain.size, self._num_micro(), self.opts.repack_slack, self.opts.min_stages,
                            memory=mem, capacity=self.opts.memory_cap, first_memory=first_mem,
                            last_memory=last_mem, time_fn=t_iter, **self.loads_kw())
        if sizes is None:
            return None
        full = expand_repack(sizes, chain.size)
        kept = tuple(r for r, s in zip(chain.ranks, full) if s > 0)
        released = tuple(r for r, s in zip(chain.ranks, full) if s == 0)
        return StagePartition(sizes=tuple(sizes), ranks=kept, step=step, balancer="repack", released=released,
                              predicted_time_s=t_iter(sizes), previous_time_s=t_iter(self.r.sizes),
                              meta={"from": list(self.r.sizes), "costs": [round(float(c), 6) for c in costs]})

    def apply(self, sizes: list[int], why: str, step: int, lr: float | None = None) -> dict[str, Any]:
        """Migrate to `sizes` (over the current chain; fewer entries re-packs) on every rank of the chain."""
        r = self.r
        full = expand_repack(sizes, r.chain.size)
        if full == list(r.sizes):
            return {}
        old = list(r.sizes)
        self._proposed = None  # plans from here on compare against the new partition
        if why in ORDERS:
            self.trial = None  # an order replaces both the partition under trial and the one it replaced
            self.feedback.cancel()
        r.optimizer, rep = migrate_layers(r.stage, r.chain, old, full, r.optimizer, r.scheme, r._make_optimizer,
                                          experts=r.experts)
        if lr is not None:
            r._set_lr(lr)
        kept = [x for x, s in zip(r.chain.ranks, full) if s > 0]
        released = [x for x, s in zip(r.chain.ranks, full) if s == 0]
        out = self._migration_event(why, old, full, rep, released)
        if r.dims.rank in released:
            r.released_at = step
            r.chain.close()
        else:
            r.chain.shrink(kept)
            r.sizes = [s for s in full if s > 0]
        r.after_migration()
        self._want_after_gantt = True
        return out

    def _migration_event(self, why: str, old: list[int], new: list[int], rep: MigrationReport,
                         released: list[int]) -> dict[str, Any]:
        """Report a migration (numbers agreed along the chain and over replicas) and calibrate the migration
        bandwidth on it: the next adoption decision costs moves at what this one really took."""
        r = self.r
        v = torch.zeros(1 + r.P0, dtype=torch.float64)
        v[0], v[1 + r._orig_pos()] = float(rep.bytes_sent), rep.seconds
        tot = r.chain.allreduce_sum(r._stage_mean(v))
        seconds = float(tot[1:].max())
        moved = len(rep.moves)
        if moved and tot[0] > 0:
            measured = float(tot[0]) / max(seconds - self.r.latency * moved, 1e-6)
            self.bandwidth = measured if self.bandwidth is None else 0.5 * float(self.bandwidth) + 0.5 * measured
        return {"migration": why, "sizes_before": old, "sizes_after": [s for s in new if s > 0],
                "layers_moved": moved, "bytes_moved": int(tot[0]), "migration_s": round(seconds, 6),
                "released_ranks": released}

    # ---- timelines and records ----
    def keep_gantt(self, which: str, res: IterationResult) -> None:
        """Keep one iteration's per-op timeline of every stage ('before' the first adopted plan, 'after' it)."""
        if not self.r.record_ops or (which == "before" and "before" in self.gantt):
            return
        kinds = {"F": 0.0, "B": 1.0, "W": 2.0}
        rows = torch.tensor([[float(self.r.chain.index), kinds[k], float(j), s, e] for k, j, s, e in res.ops],
                            dtype=torch.float64).reshape(-1)
        parts = self.r.chain.allgather_1d(rows)
        table = torch.cat(parts).reshape(-1, 5)
        t0 = float(table[:, 3].min()) if table.numel() else 0.0
        table[:, 3:] -= t0
        self.gantt[which] = table.tolist()

    def record_fields(self) -> dict[str, Any]:
        """The step record's planning figures: the current partition's predicted imbalance, kappa."""
        if not self.tracker.ready:
            return {}
        loads = stage_loads(self.costs(), self.r.sizes, **self.loads_kw())
        return {"predicted_imbalance": round(imbalance(loads), 4), "kappa": round(self.kappa or 1.0, 4)}

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        """The smoothed costs, link figures and the feedback loop (identical on every rank), as JSON."""
        return {"tracker": self.tracker.state_dict(), "kappa": self.kappa, "bandwidth": self.bandwidth,
                "comm_s": self.comm_s, "static_mem": self.static_mem.tolist(),
                "move_bytes": self.move_bytes.tolist(),
                "feedback": {"loop": self.feedback.state_dict(), "trial": self.trial}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a saved rank's state (the costs only when they count the same units)."""
        if len(state["tracker"]["fwd"]) == self.U + 2:
            self.tracker.load_state_dict(state["tracker"])
            self.static_mem = np.asarray(state["static_mem"], dtype=np.float64)
            self.move_bytes = np.asarray(state["move_bytes"], dtype=np.float64)
        self.kappa, self.bandwidth, self.comm_s = state["kappa"], state["bandwidth"], state["comm_s"]
        fb = state.get("feedback") or {}
        self.feedback.load_state_dict(fb.get("loop") or {})
        self.trial = fb.get("trial")
