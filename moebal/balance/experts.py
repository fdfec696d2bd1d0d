"""The expert-level balancer: Pro-Prophet placement observed, planned, applied and checked in one place.

Shape legend: R = ranks of an "ep" group, E = experts of an MoE layer, L = MoE layers held, X = packed statistics.

`ExpertBalancer` runs the loop for the MoE layers it holds, every rank of an "ep" group alike:
  observe   the step's per-expert counts of every held layer, all-gathered over the "ep" group (R x E each)
  plan      one `ExpertPlanner` (moebal/planner/placement.py) per layer forecasts step j+1 from step j
  apply     the placements go to the `ExpertParallel` executor (moebal/distributed/expert_parallel.py):
            Trans before the step, Agg of replica gradients after the backward pass
  check     `PlanFeedback` (balance/feedback.py) compares the step time under the plan with the step time under
            static placement and says which of the two the next step applies (`planner.feedback`)
Every rank plans from the same gathered counts and the same coefficients and feeds the feedback the same time
(the maximum over the "ep" group: a stage is as slow as its slowest expert shard), so the ranks agree on every
placement without a broadcast.

Two adapters drive it:
  ExpertParallelHook  a trainer `Hook` for expert parallelism alone: Trans in before_step, Agg and gradient sync
                      in after_backward, counts from the routing-statistics all-gather in reduce_stats, planning
                      in after_step; it also plans the communication (token chunks per layer, gradient chunk
                      size: moebal.planner.comm_plan) and writes plans.jsonl and the communication logs.
  StageExperts        the MoE layers of one pipeline stage (moebal/pipeline/runner.py): the same balancer keyed by
                      global layer id, plus what is stage-specific: a layer's planner travels with the layer when
                      it migrates (`layer_state` / `load_layer_state` / `drop_layer`).

Cost source, chosen once per balancer from `planner.costs`: a hardware profile (the analytic cost model), or
figures measured on the job (moebal/distributed/calibrate.py): by the hook on its first layer's dispatcher when
training starts, by a stage at construction on a scratch layer (a stage may hold no MoE layer yet) and agreed
over the job (the slowest rates), so a layer is planned alike on whichever stage it sits. Measured figures travel
in the checkpoints: a resumed run plans from the same numbers, hence the same placements, as the uninterrupted
one (a re-measurement would differ and change replicas, so the summation order, so the last bits of the loss).

Overlap: plans are costed with Trans/Agg hidden under compute (Pro-Prophet's eq. 8 instead of eq. 6) when
`planner.overlap` is set or when the executor does overlap them (`ExpertParallel.overlap`:
`scheduler.block_overlap`, in the expert-parallel trainer and in pipeline stages alike; the window is one
micro-batch's compute). One rule for both adapters: the executor is asked what it does, so a plan is never
costed for an overlap that does not happen, nor the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moebal.balance.feedback import PlanFeedback
from moebal.config import Config, SchedulerConfig
from moebal.distributed.expert_parallel import ExpertParallel, StatsReducer
from moebal.distributed.groups import ParallelDims
from moebal.distributed.plan_ahead import ACCURACY_KEYS, mean_accuracy
from moebal.dynamism.scheme import as_decoder
from moebal.planner.comm_plan import CommCosts, a2a_chunks
from moebal.planner.perf import MoELayerCosts, placement_loads
from moebal.planner.placement import ExpertPlanner, placement_metrics, plan_experts
from moebal.planner.plan import ExpertPlacement
from moebal.routing import RoutingStats
from moebal.routing.stats import packed_numbers
from moebal.scheduler import CommScheduler, step_record, write_chrome_trace
from moebal.sync import to_host
from moebal.train.hooks import Hook
from moebal.train.metrics import MetricsLog, routing_record
from moebal.train.precision import uses_bf16

if TYPE_CHECKING:
    from moebal.distributed.plan_ahead import PlanAhead, SavedWindow
    from moebal.pipeline.stage import PipelineStage
    from moebal.train.checkpoint import CheckpointReader
    from moebal.train.distributed import RunContext
    from moebal.train.trainer import Trainer

__all__ = ["ExpertBalancer", "ExpertParallelHook", "StageExperts", "expert_parallel_hook", "refuse_idle_plan_ahead",
           "stage_metrics"]

ReduceMax = Callable[[torch.Tensor], torch.Tensor]
"""An in-place all-reduce (maximum) over the ranks that apply one plan."""


class ExpertBalancer:
    """Observe -> plan -> apply -> check for the MoE layers of one "ep" group (see the module docstring).

    Layers are keyed by an id (the position among the executor's layers, or a global layer id in a pipeline).
    `costs` None: measured by `measure` on the first `ensure_costs` (a collective over the group)."""

    def __init__(self, cfg: Config, num_ranks: int, costs: MoELayerCosts | None, *, executor_overlaps: bool,
                 measure: Callable[[], MoELayerCosts] | None = None, overlap_share: float = 1.0) -> None:
        """`overlap_share`: the share of the step's compute that Trans and Agg can hide under with overlap (eq. 8):
        1 / A when the step runs A forwards (`train.grad_accum`) and Trans overlaps the first, Agg the last."""
        p = cfg.planner
        self.overlap_share = overlap_share
        self.policy, self.every, self.ema, self.hysteresis = p.policy, p.every, p.ema, p.hysteresis
        self.E, self.R = cfg.moe.num_experts, num_ranks
        self.measured = p.costs == "measure"  # the figures belong to this run: checkpoints keep them
        self.costs, self._measure = self._windowed(costs), measure
        self.overlap = (p.overlap or executor_overlaps) and p.policy == "prophet"
        self.max_replicas = p.max_replicas
        self.planners: dict[int, ExpertPlanner] = {}
        self.feedback = PlanFeedback(p.feedback)
        self.used: dict[int, ExpertPlacement] = {}  # what the step running now applies
        self.used_arm = "plan"  # ... and from which arm
        self.metrics: dict[int, dict[str, float]] = {}  # per layer, of the last observed step
        self.predicted_gain = 0.0  # of the planner's placements on the last observed counts
        self._gains: list[float] = []  # the predicted gains of the steps the feedback is judging
        self._t0 = 0.0

    # ---- coefficients and planners ----
    def ensure_costs(self) -> None:
        if self.costs is None:
            assert self._measure is not None, "ExpertBalancer needs costs or a way to measure them"
            self.set_costs(self._measure())

    def _windowed(self, costs: MoELayerCosts | None) -> MoELayerCosts | None:
        if costs is None or self.overlap_share == costs.overlap_share:
            return costs
        return dataclasses.replace(costs, overlap_share=self.overlap_share)

    def set_costs(self, costs: MoELayerCosts) -> None:
        windowed = self._windowed(costs)
        assert windowed is not None
        self.costs = windowed
        for pl in self.planners.values():
            pl.cost = windowed

    def new_planner(self) -> ExpertPlanner:
        extra: dict[str, Any] = {"overlap": True} if self.overlap else {}
        if self.max_replicas is not None:
            extra["max_replicas"] = self.max_replicas
        return ExpertPlanner(self.E, self.R, self.policy, self.costs, every=self.every, ema=self.ema,
                             hysteresis=self.hysteresis, **extra)

    def plan_ahead(self, i: int, est_RE: np.ndarray) -> ExpertPlacement:
        """Layer i's placement from an estimated R x E count matrix (planner.plan_ahead: the tokens' sample
        paths), with the layer's policy, options and this balancer's coefficients: every rank that gives the same
        matrix gets the same placement."""
        pl = self.planners[i]
        return plan_experts(est_RE, self.policy, self.costs, pl.owner, **pl.options)

    def add_layer(self, i: int) -> ExpertPlanner:
        self.planners[i] = self.new_planner()
        return self.planners[i]

    def drop_layer(self, i: int) -> None:
        self.planners.pop(i, None)
        self.metrics.pop(i, None)
        self.used.pop(i, None)

    # ---- apply ----
    @property
    def arm(self) -> str:
        """What the next step applies: the planner's placements ("plan") or static placement ("base")."""
        return "plan" if self.feedback.use_plan() else "base"

    def next_placements(self, ids: list[int]) -> list[ExpertPlacement]:
        """Placements of the next step for layers `ids`, as the feedback's arm says (no side effect)."""
        if self.feedback.use_plan():
            return [self.planners[i].current for i in ids]
        return [ExpertPlacement.static(self.E, self.R, self.planners[i].owner) for i in ids]

    def begin_step(self, ids: list[int]) -> list[ExpertPlacement]:
        """The placements to apply now (remembered for the metrics); starts the step's clock."""
        self.used_arm = self.arm
        placements = self.next_placements(ids)
        self.used = dict(zip(ids, placements))
        self._t0 = time.perf_counter()
        return placements

    def step_time(self, reduce_max: ReduceMax, device: torch.device) -> float | None:
        """Seconds since `begin_step`, the maximum over the group (one small all-reduce); None where the
        feedback will not use it (no loop, or no trial running: `PlanFeedback.wants_time`, the same on every
        rank), and no collective then. Call it after the step's last host sync, so device work is counted."""
        if not self.feedback.wants_time():
            return None
        t = torch.tensor([time.perf_counter() - self._t0], dtype=torch.float64, device=device)
        return float(to_host(reduce_max(t), "step time")[0])

    # ---- observe and plan ----
    def observe(self, counts: dict[int, np.ndarray], step: int, step_s: float | None) -> None:
        """One step's R x E counts per layer: metrics of the placements used, the planners stepped, the step's
        time into the feedback."""
        self.metrics, static_s, planned_s = {}, 0.0, 0.0
        for i, c_RE in counts.items():
            pl = self.planners[i]
            used = self.used.get(i, pl.current)
            self.metrics[i] = placement_metrics(c_RE, used, self.costs)
            plan = self.metrics[i] if used is pl.current else placement_metrics(c_RE, pl.current, self.costs)
            static_s += plan["static_time_s"]
            planned_s += plan["predicted_time_s"]
            pl.step(c_RE)
        self.predicted_gain = 1.0 - planned_s / static_s if static_s > 0 else 0.0
        if self.feedback.cfg.enabled:
            self._gains = [*self._gains, self.predicted_gain][-2 * self.feedback.cfg.window:]  # a trial's steps
            self.feedback.observe(step, step_s)

    def decisions(self) -> list[dict[str, Any]]:
        """The feedback's verdicts since the last call, each with the planner's mean predicted gain over the
        judged steps beside the measured one."""
        events = self.feedback.drain()
        for e in events:
            e["predicted_gain"] = round(float(np.mean(self._gains)), 4) if self._gains else 0.0
        return events

    # ---- checkpoints ----
    @staticmethod
    def planner_state(pl: ExpertPlanner) -> dict[str, Any]:
        return {"forecast": None if pl.forecast_RE is None else pl.forecast_RE.tolist(),
                "observed": pl.observed, "current": pl.current.to_dict()}

    def load_planner(self, i: int, saved: dict[str, Any] | None) -> ExpertPlanner:
        """A fresh planner for layer i, restored from `saved` (a `planner_state`) when given."""
        pl = self.add_layer(i)
        if saved is not None:
            pl.forecast_RE = None if saved["forecast"] is None else np.asarray(saved["forecast"], dtype=np.float64)
            pl.observed = int(saved["observed"])
            pl.current = ExpertPlacement.from_dict(saved["current"])
        return pl

    def costs_state(self) -> dict[str, Any] | None:
        from moebal.distributed.calibrate import costs_to_dict

        return costs_to_dict(self.costs) if self.measured and self.costs is not None else None

    def load_costs(self, saved: dict[str, Any] | None) -> None:
        if self.measured and saved:
            from moebal.distributed.calibrate import costs_from_dict

            self.set_costs(costs_from_dict(saved))  # no re-measurement: the same plans


# ---- expert parallelism alone: the trainer's hook -------------------------------------------------------------

def _logs(trainer: Trainer, step: int) -> bool:
    """Whether the step's lines go to plans.jsonl and comm/rankN.jsonl: every `train.log_every` steps and the last,
    as metrics lines (each holds every layer's per-rank counts, or the step's collectives: megabytes a step at
    hundreds of experts and ranks)."""
    t = trainer.cfg.train
    return step % t.log_every == 0 or step == t.steps


class ExpertParallelHook(Hook):
    """The `ExpertBalancer` of the trainer's expert-parallel layers, with the step's communication plan.

      before step     apply: the feedback's arm of placements, Trans (all layers now, or layer 0 now and the
                      rest overlapped); the token chunks planned for them
      after backward  Agg (replica gradients back to their owners), then the chunked gradient sync
      reduce stats    observe: one all-gather of every layer's packed statistics over "dp_ep"; the step time
      after step      plan: placements and token chunks of the next step; records and plans.jsonl
    With `planner.plan_ahead: path` a `PlanAhead` (moebal/distributed/plan_ahead.py) plans the ahead layers inside
    the forward instead; after the step their placements and forecast accuracy go into the records.
    Every collective goes through the rank's `CommScheduler`, whose event log becomes comm/rank<r>.jsonl, a
    Chrome trace of one step (comm_trace.json) and the step's exposed communication time in metrics.jsonl."""

    def __init__(self, ep: ExpertParallel, cfg: Config, costs: MoELayerCosts | None, ctx: RunContext,
                 measure: Callable[[], MoELayerCosts] | None = None, comm_costs: CommCosts | None = None,
                 measure_comm: Callable[[MoELayerCosts], CommCosts] | None = None) -> None:
        """`costs`: the planner's coefficients (from a hardware profile), or None with `measure`, which measures
        them on the job at the start of training unless a checkpoint brought the figures of the run's first
        measurement. `comm_costs` / `measure_comm` (given the layer costs): the same for the communication plan
        (gradient chunk size, token chunks)."""
        self.ep, self.ctx = ep, ctx
        self.comm_costs, self._measure_comm = comm_costs, measure_comm
        self.sched, self.sc = ep.sched, cfg.scheduler
        R = ep.dims.size("ep")
        self.balancer = ExpertBalancer(cfg, R, costs, executor_overlaps=ep.overlap, measure=measure,
                                       overlap_share=1.0 / cfg.train.grad_accum)
        self.ids = list(range(len(ep.layers)))
        for i in self.ids:
            self.balancer.add_layer(i)
        tokens = cfg.data.batch_size * cfg.data.seq_len // ep.dims.size("dp_ep") * cfg.moe.top_k
        self._uniform = np.full((R, cfg.moe.num_experts), tokens / cfg.moe.num_experts)
        # rows travel in the compute dtype: bf16 under autocast (ExpertParallel.forward casts them), else fp32
        self.token_bytes = cfg.model.dim * (2 if uses_bf16(cfg, ep.dims.device) else 4)
        self.chunks: list[int] | None = None  # token chunks per layer for the next step (None: not planned yet)
        self._counts_RE: list[np.ndarray] = []
        self._step_s: float | None = None
        self._log: Any = None
        self._events: Any = None
        self._t_opt = 0.0
        self.ahead = _plan_ahead(cfg, ep, self.balancer)
        self._windows: dict[int, SavedWindow] | None = None  # read from a checkpoint, installed on load
        ep.set_plan_ahead(self.ahead)
        # train.grad_accum: the step's counts arrive over this many equal forwards, each exchanging 1/A of them;
        # the planner plans on the step's (compute is paid on every forward, Trans and Agg once per step), the
        # token chunks of one exchange on one forward's; gradients that go out during the backward pass are
        # armed for the last micro-batch only (`before_last_micro_batch`)
        self.micro_batches = cfg.train.grad_accum
        ep.defer_gradient_sync = self.micro_batches > 1
        if self.ahead is not None:
            self.ahead.set_step_scale(float(self.micro_batches))

    @property
    def name(self) -> str:
        return "expert_parallel"

    @property
    def planners(self) -> list[ExpertPlanner]:
        return [self.balancer.planners[i] for i in self.ids]

    @property
    def costs(self) -> MoELayerCosts | None:
        return self.balancer.costs

    def _chunks_for(self, counts_RE: np.ndarray, placement: ExpertPlacement) -> int:
        """Token chunks of one layer's exchanges (fixed by scheduler.a2a_chunks, else the cost model's best)."""
        if self.sc.a2a_chunks is not None:
            return self.sc.a2a_chunks
        if self.comm_costs is None:
            return 1
        H_R, recv_R = placement_loads(counts_RE / self.micro_batches, placement)  # one forward's exchange
        return a2a_chunks(self.comm_costs, float(recv_R.max()) * self.token_bytes, float(H_R.max()))[0]

    def on_start(self, trainer: Trainer) -> None:
        self.balancer.ensure_costs()  # collective: every rank of the EP group measures together
        if self.comm_costs is None and self._measure_comm is not None:
            assert self.costs is not None
            self.comm_costs = self._measure_comm(self.costs)  # collective as well
        if self.comm_costs is not None:
            R = self._uniform.shape[0]  # one exchange under balanced routing: the rows that leave the rank
            a2a_s = (self._uniform.sum(axis=1).max() / self.micro_batches * (R - 1) / R * self.token_bytes
                     / self.comm_costs.a2a_bandwidth)
            grads = self.ep.grads
            if grads is not None:  # none under sharded state: the optimizer reduce-scatters
                self.ep.set_chunk_bytes(chunk_bytes(self.sc, self.comm_costs, grads.reduced_bytes, a2a_s))
        if self.chunks is None:
            self.chunks = [self._chunks_for(self._uniform, plc) for plc in self.balancer.next_placements(self.ids)]
        if self.ctx.is_main:
            path = trainer.run_dir / "plans.jsonl"
            MetricsLog.truncate_after(path, trainer.step)  # a resumed run re-plans the steps after its checkpoint
            self._log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_end
        if self.sc.events:
            path = trainer.run_dir / "comm" / f"rank{self.ep.dims.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            MetricsLog.truncate_after(path, trainer.step)
            self._events = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_end

    def before_step(self, trainer: Trainer, step: int) -> None:
        self.sched.log.begin(step)
        self.sched.start_compute()  # the emulated device's clock (scheduler.dilate) starts with the step
        for d, c in zip(self.ep.dispatchers, self.chunks or []):
            d.a2a_chunks = c
        placements = self.balancer.begin_step(self.ids)
        self.ep.apply(placements, plan_ahead=self.balancer.used_arm == "plan")

    def before_last_micro_batch(self, trainer: Trainer, step: int) -> None:
        self.ep.arm_gradient_sync()

    def after_backward(self, trainer: Trainer, step: int) -> None:
        self.ep.aggregate()  # Agg, before the optimizer step
        self.ep.sync_gradients()  # waits for the chunks still in flight
        self._t_opt = time.perf_counter()

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        """Keep each rank's counts (the planner's R x E matrix) and return the statistics summed over the
        stage's ranks: one all-gather of every layer's packed statistics over "dp_ep" (it holds the "ep"
        group's rows too) and one host read of the expert-parallel group's counts; then the step's time."""
        dims = self.ep.dims
        packed_LX = torch.stack([s.packed() for s in stats])
        gathered = [torch.empty_like(packed_LX) for _ in range(dims.size("dp_ep"))]
        self.sched.run("stats", lambda: dist.all_gather(gathered, packed_LX, group=dims.group("dp_ep"),
                                                        async_op=True),
                       name="routing stats", nbytes=packed_LX.numel() * packed_LX.element_size() * len(gathered))
        all_WLX = torch.stack(gathered)
        E = stats[0].counts_E.numel()
        members = dims.ranks_of("dp_ep")
        rows = [members.index(r) for r in dims.ranks_of("ep")]
        counts_RLE = np.asarray(to_host(all_WLX[rows, :, :E], "placement counts"), dtype=np.float64)
        self._counts_RE = [np.ascontiguousarray(counts_RLE[:, i]) for i in range(len(stats))]
        # after the host read above: the device's work of the step is done and counted
        self._step_s = self.balancer.step_time(
            lambda t: self.sched.all_reduce(t, dims.group("ep"), name="step time", op=dist.ReduceOp.MAX),
            packed_LX.device)
        summed_LX = all_WLX.sum(dim=0)
        return [RoutingStats.unpack(summed_LX[i], E) for i in range(len(stats))]

    def after_step(self, trainer: Trainer, step: int, stats: list[RoutingStats], record: dict[str, Any]) -> None:
        self.ep.release()  # replicas hold pre-update weights; validation and the next Trans must not see them
        self.sched.log.span("compute", "optimizer", self._t_opt)
        b = self.balancer
        if self.ahead is not None:
            self._plan_ahead_step(record)
        used = [b.used[i] for i in self.ids]
        arm = b.used_arm
        b.observe(dict(zip(self.ids, self._counts_RE)), step, self._step_s)
        metrics = [b.metrics[i] for i in self.ids]
        nxt = b.next_placements(self.ids)
        used_chunks = list(self.chunks or [])
        self.chunks = [self._chunks_for(c, p) for c, p in zip(self._counts_RE, nxt)]
        record["rank_imbalance_before"] = [round(m["imbalance_before"], 4) for m in metrics]
        record["rank_imbalance_after"] = [round(m["imbalance_after"], 4) for m in metrics]
        record["replicas"] = [p.num_replicas for p in used]
        record["trans_bytes"] = int(sum(m["trans_bytes"] for m in metrics))
        record["a2a_bytes"] = int(sum(m["a2a_bytes"] for m in metrics))
        record["plan_ms"] = round(1e3 * sum(pl.last.get("plan_s", 0.0) for pl in self.planners), 3)
        record["a2a_chunks"] = used_chunks
        record["predicted_gain"] = round(b.predicted_gain, 4)
        decisions = self._record_feedback(record, arm)
        self._record_comm(trainer, step, record)
        if self._log is not None and (_logs(trainer, step) or decisions):  # a verdict is never left out
            line: dict[str, Any] = {
                "step": step, "counts": [c.astype(int).tolist() for c in self._counts_RE],
                "used": [p.to_dict() for p in used], "next": [p.current.to_dict() for p in self.planners],
                "metrics": metrics, "a2a_chunks": used_chunks, "predicted_gain": record["predicted_gain"]}
            if b.feedback.cfg.enabled:
                line.update(arm=arm, next_arm=b.arm, step_s=self._step_s, feedback=decisions)
            self._log.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._log.flush()

    def _plan_ahead_step(self, record: dict[str, Any]) -> None:
        """The step's ahead placements become the ones it used (metrics, plans.jsonl); the accuracy of the path
        estimate the plans ran with against the previous-iteration forecast, on the real counts; the online
        profile takes the step's routing."""
        a, b = self.ahead, self.balancer
        assert a is not None
        for j in a.armed:  # an ahead layer runs static until its plan arrives (always, on a complete forward)
            b.used[j] = a.placed.get(j, ExpertPlacement.static(b.E, b.R, b.planners[j].owner))
        counts = dict(zip(self.ids, self._counts_RE))
        previous = {j: b.planners[j].forecast_RE for j in a.estimates}
        k = self.ep.layers[0].top_k if self.ep.layers else 1
        acc = a.accuracy(counts, previous, min(2 * k, b.E))
        record["plan_ahead_layers"] = sorted(a.placed)
        record.update({f"plan_ahead_{key}": round(v, 4) for key, v in acc.items()})
        a.end_step()

    def _record_feedback(self, record: dict[str, Any], arm: str) -> list[dict[str, Any]]:
        """The closed loop's fields of the step record: the arm the step ran, its measured time (maximum over
        the "ep" group) and the verdicts taken after it (with predicted and measured gains)."""
        decisions = self.balancer.decisions()
        if self.balancer.feedback.cfg.enabled:
            record["placement_arm"] = arm
            record["placement_step_s"] = None if self._step_s is None else round(self._step_s, 6)
            if decisions:
                record["placement_feedback"] = decisions
        return decisions

    def _record_comm(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        """The step's communication: means over ranks into the metrics record, this rank's events into its log
        file, and on `scheduler.trace_step` a Chrome trace of every rank (gathered on rank 0)."""
        comm = self.sched.log.end()
        line = step_record(comm, self.ep.dims.rank)
        vals = self.ctx.sum([comm.exposed_s, comm.a2a_s, comm.allreduce_s, comm.placement_s, comm.a2a_shared_s,
                             comm.held_s, comm.step_s])
        n = self.ep.dims.size("dp_ep")
        # comm_window_s: from Trans to the step's bookkeeping; a mean over ranks as the others (the dashboard's
        # panel says so; it was this rank's own)
        for key, v in zip(("exposed_comm_s", "a2a_s", "allreduce_s", "placement_comm_s", "a2a_shared_s", "held_s",
                           "comm_window_s"), vals):
            record[key] = round(v / n, 6)
        if self._events is not None and _logs(trainer, step):
            self._events.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._events.flush()
        if step == self.sc.trace_step:
            gathered: list[Any] = [None] * self.ep.dims.world_size
            dist.all_gather_object(gathered, line)
            if self.ctx.is_main:
                write_chrome_trace(gathered, trainer.run_dir / "comm_trace.json")

    def on_end(self, trainer: Trainer) -> None:
        for f in (self._log, self._events):
            if f is not None:
                f.close()
        self._log = self._events = None

    def state_dict(self) -> dict[str, Any]:
        """Planner forecasts, the placements and token chunks of the next step, measured coefficients and the
        feedback's state, so a resumed run plans what the uninterrupted run would have (placements and chunks
        change only summation order, but resume is bitwise)."""
        b = self.balancer
        return {"placements": [p.current.to_dict() for p in self.planners],
                "planners": [b.planner_state(pl) for pl in self.planners],
                "measured_costs": b.costs_state(),
                "comm_costs": self.comm_costs.to_dict() if self._measure_comm and self.comm_costs else None,
                "a2a_chunks": self.chunks, "feedback": b.feedback.state_dict()}

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Plan-ahead's online profile state (the routing window, the refresh counter) of this rank's tokens,
        by MoE layer (`PlanAhead.window_tensors`); none without plan-ahead or with a loaded profile."""
        if self.ahead is None:
            return {}
        d = self.ep.dims
        return self.ahead.window_tensors(0, d.index("dp_ep"), d.size("dp_ep"))

    def read_tensors(self, reader: CheckpointReader) -> None:
        """Read plan-ahead's saved online profile state of this rank's tokens and agree over the job whether
        every rank can continue it (`_windows_fit`); `load_state_dict` installs it."""
        a = self.ahead
        if a is None or not a.online:
            return
        d, gather = self.ep.dims, self.ctx.gather
        saved = _read_windows(reader, d.index("dp_ep"), gather)
        fits = _windows_fit(a, saved, 0, d.size("dp_ep"), gather, "" if self.ctx.is_main else None)
        self._windows = saved if fits else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ahead is not None and self._windows is not None:
            self.ahead.load_window(self._windows, 0)
            self._windows = None
        if not state:
            return
        placements = [ExpertPlacement.from_dict(d) for d in state["placements"]]
        if len(placements) != len(self.ids) or any(p.num_ranks != self.ep.dims.size("ep") for p in placements):
            return  # a checkpoint of another expert-parallel size: plan afresh (and measure this layout's costs)
        b = self.balancer
        for i, saved in zip(self.ids, state["planners"]):
            b.load_planner(i, saved)
        b.load_costs(state.get("measured_costs"))
        if self._measure_comm is not None and state.get("comm_costs"):
            self.comm_costs = CommCosts(**state["comm_costs"])
        if state.get("a2a_chunks"):
            self.chunks = [int(c) for c in state["a2a_chunks"]]
        b.feedback.load_state_dict(state.get("feedback") or {})


def expert_parallel_hook(cfg: Config, ep: ExpertParallel, dims: ParallelDims, ctx: RunContext) -> ExpertParallelHook:
    """The trainer's hook with its planner and scheduler coefficients: from a hardware profile now, or measured
    on the job when training starts (`planner.costs: measure`) unless a resumed checkpoint holds the run's
    measurement."""
    tokens = _forward_tokens(cfg, dims)
    if cfg.planner.costs == "measure":
        from moebal.distributed.calibrate import measure_comm_costs, measure_layer_costs

        return ExpertParallelHook(
            ep, cfg, None, ctx, measure=lambda: measure_layer_costs(ep.dispatchers[0], tokens * cfg.moe.top_k,
                                                                    dilate=cfg.scheduler.dilate),
            measure_comm=lambda layer: measure_comm_costs(ep.dispatchers[0], dims.group("dp_ep"),
                                                          tokens * cfg.moe.top_k, layer, dilate=cfg.scheduler.dilate))
    from moebal.planner.comm_plan import comm_costs_from_profile

    cost, costs = _profile_costs(cfg, dims)
    comm = comm_costs_from_profile(cost, costs, dims.ranks_of("ep"), dims.ranks_of("dp_ep"))
    return ExpertParallelHook(ep, cfg, costs, ctx, comm_costs=comm)


def chunk_bytes(sc: SchedulerConfig, comm_costs: CommCosts, total_bytes: float, a2a_s: float) -> float:
    """Gradient chunk: ddp's bucket, `scheduler.chunk_mb`, or the cost model's (`ar_chunk_bytes`)."""
    from moebal.planner.comm_plan import ar_chunk_bytes

    if sc.mode == "ddp":
        return sc.bucket_mb * 1e6
    return sc.chunk_mb * 1e6 if sc.chunk_mb else ar_chunk_bytes(comm_costs, total_bytes=total_bytes, a2a_s=a2a_s)


def _forward_tokens(cfg: Config, dims: ParallelDims) -> int:
    """Tokens of one forward per rank: the rank's rows of the batch, in `train.grad_accum` micro-batches."""
    return cfg.data.batch_size * cfg.data.seq_len // dims.size("dp_ep") // cfg.train.grad_accum


def _profile_costs(cfg: Config, dims: ParallelDims) -> tuple[Any, MoELayerCosts]:
    """The hardware profile `planner.costs` names and its coefficients for one MoE layer of this layout."""
    from moebal.planner.cost import CostModel, ModelShape

    # the expert GEMMs run on one forward's rows (train.grad_accum: a micro-batch's); the layer's other work is
    # paid on every forward of the step
    A = cfg.train.grad_accum
    cost = CostModel(cfg.planner.costs, "bf16" if uses_bf16(cfg, dims.device) else "fp32")  # the bytes the run sends
    c = cost.moe_layer_costs(ModelShape.from_config(cfg), dims.ranks_of("ep"), _forward_tokens(cfg, dims),
                             cfg.data.seq_len)
    if A > 1:
        c = dataclasses.replace(c, nonmoe_fwd_s=c.nonmoe_fwd_s * A, nonmoe_bwd_s=c.nonmoe_bwd_s * A)
    return cost, c


def _plan_ahead(cfg: Config, ep: ExpertParallel, balancer: ExpertBalancer) -> PlanAhead | None:
    """The plan-ahead planner of `planner.plan_ahead: path` (None when off): a loaded profile, or built online."""
    p = cfg.planner
    if p.plan_ahead == "off":
        return None
    from moebal.distributed.plan_ahead import PlanAhead
    from moebal.planner.paths import PathProfile

    profile = PathProfile.load(p.path_profile) if p.path_profile else None
    return PlanAhead(len(ep.layers), cfg.moe.num_experts, p.path_len, balancer.plan_ahead, ep.dims.device,
                     profile, top_k=cfg.moe.top_k, refresh=p.path_refresh, window=p.path_window)


def _read_windows(reader: CheckpointReader, shard: int, gather: Callable[[Any], list[Any]]
                  ) -> dict[int, SavedWindow]:
    """This rank's saved plan-ahead windows (`read_windows`); a malformed entry on any rank of `gather` is every
    rank's CheckpointError."""
    from moebal.distributed.plan_ahead import read_windows
    from moebal.errors import CheckpointError

    error, saved = None, {}
    try:
        saved = read_windows(reader, shard)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    return saved


def _windows_fit(ahead: PlanAhead, saved: dict[int, SavedWindow], first: int, shards: int,
                 gather: Callable[[Any], list[Any]], say: str | None) -> bool:
    """Whether every rank of `gather` can continue its online profile from its saved windows
    (`PlanAhead.window_misfit`): all or none, since the ranks of an "ep" group must agree on their ahead layers.
    When not, `say` (a prefix: the rank that reports) writes the first rank's reason."""
    whys = [w for w in gather(ahead.window_misfit(saved, first, shards)) if w]
    if whys and say is not None:
        sys.stderr.write(f"moebal: {say}plan-ahead's online path profile starts empty on resume: {whys[0]}; layers "
                         f"are planned ahead again after its first build, planner.path_refresh steps from now\n")
    return not whys


# ---- expert parallelism inside pipeline stages ---------------------------------------------------------------

class StageExperts:
    """The MoE layers of one pipeline stage under expert parallelism, balanced by an `ExpertBalancer`.

    Layout (`moebal/distributed/groups.py`): a stage is held by dp x ep ranks ("dp_ep"); its MoE layers shard
    their experts over the stage's "ep" group. A pipeline chain is one (dp, ep) coordinate's ranks, so the chain
    member at stage p holds expert shard `ep` of every MoE layer of stage p: migrating a layer along the chain
    moves shard e, its gradients and its AdamW state straight to the rank of the receiving stage that must hold
    shard e, and its planner (forecast, current placement) with it (`layer_state`), so a run with migrations
    places experts exactly as the run without and its losses are the same bit for bit.

    Per step, on every rank of a stage (called by the runner):
      1. `before_step`: adopt each MoE layer's placement (the feedback's arm) and run Trans (collective, "ep")
      2. `after_backward`: Agg, drop the replicas; take each MoE layer's step statistics and all-gather them over
         the stage ("dp_ep", one collective on the compute device, one host read): their sum steps the selection
         bias and goes to the step's record, the "ep" group's rows are the planners' R x E counts; step the
         planners, feed the step time.
    Routing statistics for the load-balancing loss are summed over the stage's ranks ("dp_ep": a differentiable
    all-reduce, `StatsReducer`), so each micro-batch's auxiliary loss is that of the micro-batch formed by every
    rank's rows; this also holds with ep = 1 and data-parallel replicas."""

    def __init__(self, stage: PipelineStage, dims: ParallelDims, cfg: Config) -> None:
        _check_stage_ep(cfg, dims)
        self.stage, self.dims, self.cfg = stage, dims, cfg
        self.R = dims.ep
        self.data_ranks = dims.size("dp_ep")
        from moebal.train.precision import autocast_dtype

        dtype = autocast_dtype(cfg, dims.device)  # replicas travel in the compute dtype
        overlap = cfg.scheduler.block_overlap
        self.ep: ExpertParallel | None = (ExpertParallel(stage, dims, _scheduler(dims, cfg), compute_dtype=dtype,
                                                         overlap=overlap) if self.R > 1 else None)
        if self.ep is not None and overlap:
            # Agg's hooks go with the forward whose backward is the stage's last (`last_pass`), not with Trans
            self.ep.defer_gradient_sync = True
        if self.ep is None:
            for i in stage.layer_ids:
                self.prepare_layer(i, stage.layer(i))
        self.balancer: ExpertBalancer | None = None
        self.step = 0  # steps observed: the feedback's clock
        self.ahead: PlanAhead | None = None  # planner.plan_ahead: path (`_rebuild_ahead`)
        self.ahead_metrics: dict[int, dict[str, float]] = {}  # per global layer id, of the last observed step
        self.routing: dict[int, np.ndarray] = {}  # per global layer id: the step's stage-summed statistics
        if self.ep is not None:
            # eq. 8's window: Trans hides under the first micro-batch's forward, Agg under the last one's backward,
            # one micro-batch's compute of the step's (as under train.grad_accum); planned micro-batching varies
            # the count per step and is priced at pipeline.micro_batches
            self.balancer = ExpertBalancer(cfg, self.R, _planner_costs(cfg, dims), executor_overlaps=self.ep.overlap,
                                           overlap_share=1.0 / cfg.pipeline.micro_batches)
            for i in self._moe_ids():
                self.balancer.add_layer(i)
            self._rebuild_ahead()

    @property
    def sharded(self) -> bool:
        return self.ep is not None

    @property
    def planners(self) -> dict[int, ExpertPlanner]:
        return {} if self.balancer is None else self.balancer.planners

    @property
    def metrics(self) -> dict[int, dict[str, float]]:
        return {} if self.balancer is None else self.balancer.metrics

    def _moe_ids(self) -> list[int]:
        return [i for i in self.stage.layer_ids if self.stage.layer(i).is_moe]

    # ---- plan-ahead inside the stage ----
    def _rebuild_ahead(self) -> None:
        """The stage's `PlanAhead` over the MoE layers it holds now (at start-up and after every migration).

        Stage boundary: the paths stop at it. A stage's first `path_len` MoE layers take the previous-iteration
        placement (as the model's first layers do in the expert-parallel trainer); the tokens' expert ids are not
        carried across with the activations, which would add a message per micro-batch to the point-to-point
        protocol (and its planned-micro-batch streams) for the few layers at each boundary.
        Migration: the path state is rebuilt, not moved: a loaded profile is cut to the new layer range at once;
        an online profile starts empty (the routing it held was of the old layer range), so the stage falls back
        to the previous iteration until its next build, `path_refresh` steps later. Placement never changes the
        maths, so neither choice changes the losses."""
        assert self.ep is not None and self.balancer is not None
        ids = self._moe_ids()
        p = self.cfg.planner
        if p.plan_ahead == "off":
            return
        from moebal.distributed.plan_ahead import PlanAhead
        from moebal.planner.paths import PathProfile

        profile = None
        if p.path_profile:
            lo = sum(self.cfg.is_moe_layer(k) for k in range(ids[0])) if ids else 0
            profile = PathProfile.load(p.path_profile)
            n_moe = sum(self.cfg.is_moe_layer(k) for k in range(self.cfg.model.n_layers))
            if profile.num_layers != n_moe:  # PlanAhead names the fix for the stage's slice; say it for the model
                raise ValueError(f"planner.path_profile describes {profile.num_layers} MoE layers; the model has "
                                 f"{n_moe}: build it from this model's routing (`moebal paths RUN_DIR`) or set "
                                 f"planner.path_profile null (built online)")
            profile = profile.layers(lo, lo + len(ids))
        balancer = self.balancer

        def plan(j: int, est_RE: np.ndarray) -> ExpertPlacement:  # stage-local index -> global layer id
            return balancer.plan_ahead(ids[j], est_RE)

        self.ahead = PlanAhead(len(ids), self.cfg.moe.num_experts, p.path_len, plan, self.dims.device, profile,
                               top_k=self.cfg.moe.top_k, refresh=p.path_refresh, window=p.path_window)
        self.ep.set_plan_ahead(self.ahead)

    def _ahead_observe(self, ids: list[int], counts: dict[int, np.ndarray]) -> None:
        """After the step, before the planners step: the ahead placements become the ones the step used, the
        forecast figures of each layer planned ahead are kept (global ids) and the online profile takes the
        step's routing."""
        a, b = self.ahead, self.balancer
        assert a is not None and b is not None
        for j in a.armed:  # an ahead layer runs static until its plan arrives (always, on a complete forward)
            b.used[ids[j]] = a.placed.get(j, ExpertPlacement.static(b.E, b.R, b.planners[ids[j]].owner))
        local = {j: counts[ids[j]] for j in range(len(ids))}
        previous = {j: b.planners[ids[j]].forecast_RE for j in a.estimates}
        k = self.cfg.moe.top_k
        self.ahead_metrics = {ids[j]: m for j, m in a.layer_accuracy(local, previous, min(2 * k, b.E)).items()}
        a.end_step()

    # ---- the step ----
    def before_step(self, forward_tokens: list[int] | None = None) -> None:
        """Trans: adopt every MoE layer's placement (collective over the ep group). `forward_tokens`: this rank's
        tokens in each forward of the step in run order (micro-batches), which scales a plan-ahead estimate made
        on the first forward to the step (`PlanAhead.set_step_scale`); None: one forward."""
        if self.ep is None:
            return
        # the stage's communication log holds one step's events (nothing reads them across steps), as the
        # expert-parallel hook's does: without a `begin` each step's would add up for the whole run
        self.ep.sched.log.begin(self.step + 1)
        if self.balancer is None:
            return
        if self.ahead is not None:
            tokens = [t for t in (forward_tokens or []) if t > 0]
            self.ahead.set_step_scale(sum(tokens) / tokens[0] if tokens else 1.0)
        placements = self.balancer.begin_step(self._moe_ids())
        self.ep.apply(placements, plan_ahead=self.balancer.used_arm == "plan")

    def last_pass(self, on: bool) -> None:
        """The engine's `last_pass` (moebal/pipeline/engine.py): with `scheduler.block_overlap`, Agg's hooks are
        armed for the forward whose backward is the stage's last of the step, so each MoE layer's replica
        gradients (that backward's plus the earlier passes' sum) leave inside it."""
        if self.ep is not None and self.ep.overlap:
            self.ep.arm_agg(on)

    def after_backward(self) -> None:
        """Agg: replica gradients back to their owners, the replicas dropped (nothing may run on them); then
        observe the step's counts and plan the next step's placements (collective over the ep group). With the
        block overlap Agg went out during the last backward and is waited for here."""
        if self.ep is not None:
            self.ep.aggregate()
            self.ep.release()
        self._observe_and_plan()

    def _take_routing(self, ids: list[int]) -> np.ndarray | None:
        """Take the step's routing statistics of the MoE layers held here (`MoELayer.take_stats`) from every rank
        of the stage: [W, N, X] int64 on the host, each layer's `RoutingStats.packed` on each of the stage's W
        ("dp_ep") ranks (one all-gather on the compute device when W > 1, one host read; None without MoE
        layers). Their sum over the stage, the statistics of the step's rows on every rank, steps each layer's
        auxiliary-loss-free selection bias on the device (`MoELayer.update_bias`, once per optimizer step, as the
        trainer without a pipeline does in `LocalStep._routing_step`) and is kept in `routing` (by global layer
        id) for the step's record. Every rank of a stage holds the same layers, so none of them gathers when it
        holds no MoE layer."""
        self.routing = {}
        if not ids:
            return None
        packed_NX = torch.stack([self.stage.layer(i).block_sparse_moe.take_stats().packed() for i in ids])
        if self.data_ranks > 1:
            gathered = [torch.empty_like(packed_NX) for _ in range(self.data_ranks)]
            dist.all_gather(gathered, packed_NX, group=self.dims.group("dp_ep"))
            all_WNX = torch.stack(gathered)
        else:
            all_WNX = packed_NX[None]
        E = self.cfg.moe.num_experts
        biased = [(n, moe) for n, i in enumerate(ids)
                  if (moe := self.stage.layer(i).block_sparse_moe).expert_bias is not None]
        if biased:
            summed_NX = all_WNX.sum(dim=0)
            for n, moe in biased:
                moe.update_bias(summed_NX[n, E:2 * E])  # the gate's choices before capacity drops
        host_WNX = np.asarray(to_host(all_WNX, "routing statistics"), dtype=np.int64)
        self.routing = {i: host_WNX[:, n].sum(axis=0) for n, i in enumerate(ids)}
        return host_WNX

    def routing_vector(self, num_layers: int) -> torch.Tensor:
        """[num_layers x X] float64: the step's stage-summed routing statistics (`routing`) of the layers held
        here, zeros elsewhere (summed along the chain, every layer comes from the stage that ran it); empty for a
        model without MoE layers."""
        if not self.cfg.moe.num_experts:
            return torch.zeros(0, dtype=torch.float64)
        v = torch.zeros(num_layers, 2 * self.cfg.moe.num_experts + self.cfg.moe.top_k + 1, dtype=torch.float64)
        for i, row in self.routing.items():
            v[i] = torch.from_numpy(row.astype(np.float64))
        return v.reshape(-1)

    def _observe_and_plan(self) -> None:
        ids = self._moe_ids()
        host_WNX = self._take_routing(ids)
        if self.ep is None or self.balancer is None:
            return  # no planner: the statistics went to the selection bias and the record only
        self.balancer.metrics, self.ahead_metrics = {}, {}
        if host_WNX is None:  # every rank of the ep group holds the same layers: none of them gathers
            if self.ahead is not None:
                self.ahead.end_step()
            return
        # the planners' R x E counts: the expert-parallel group's rows of the stage's gathered statistics
        members = self.dims.ranks_of("dp_ep")
        rows = [members.index(r) for r in self.dims.ranks_of("ep")]
        counts_RNE = host_WNX[rows, :, :self.cfg.moe.num_experts].astype(np.float64)
        group = self.dims.group("ep")
        step_s = self.balancer.step_time(lambda t: _all_reduce_max(t, group), self.dims.device)
        self.step += 1
        counts = {i: np.ascontiguousarray(counts_RNE[:, n]) for n, i in enumerate(ids)}
        if self.ahead is not None:
            self._ahead_observe(ids, counts)
        self.balancer.observe(counts, self.step, step_s)

    def vector_size(self, num_layers: int) -> int:
        """Length of `step_vector`: 3 figures per layer, 5 more with plan-ahead (0 without sharding)."""
        if self.ep is None:
            return 0
        return (3 + (1 + len(ACCURACY_KEYS) if self.cfg.planner.plan_ahead != "off" else 0)) * num_layers

    def step_vector(self, num_layers: int) -> torch.Tensor:
        """Per layer: replicas used, rank load imbalance before and after placement (0 where not held); with
        plan-ahead then 1 where the layer was planned ahead and its forecast figures (`ACCURACY_KEYS`, NaN
        where absent), each a block of `num_layers`."""
        L = num_layers
        v = torch.zeros(self.vector_size(L), dtype=torch.float64)
        for i, m in self.metrics.items():
            v[i], v[L + i], v[2 * L + i] = m["replicas"], m["imbalance_before"], m["imbalance_after"]
        if v.numel() > 3 * L:
            for i, acc in self.ahead_metrics.items():
                v[3 * L + i] = 1.0
                for n, key in enumerate(ACCURACY_KEYS):
                    v[(4 + n) * L + i] = acc.get(key, math.nan)
        return v

    def feedback_record(self) -> dict[str, Any]:
        """The closed loop's fields of this stage's step (empty without feedback): the arm the next step runs,
        the planners' predicted gain, the verdicts taken since the last call."""
        b = self.balancer
        if b is None or not b.feedback.cfg.enabled:
            return {}
        out: dict[str, Any] = {"placement_next_arm": b.arm, "predicted_gain": round(b.predicted_gain, 4)}
        decisions = b.decisions()
        if decisions:
            out["placement_feedback"] = decisions
        return out

    # ---- gradients ----
    def shard_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a per-rank quantity of the expert shards over the ep group (identity without sharding), on
        `t`'s device (the runner's gradient squares: the compute device)."""
        if self.ep is not None:
            dist.all_reduce(t, group=self.dims.group("ep"))
        return t

    # ---- migration: the same interface as a dynamism scheme's layer state ----
    def prepare_layer(self, i: int, layer: nn.Module) -> None:
        """A layer arriving here (or built here): shard its experts, sum its statistics over the stage."""
        if not getattr(layer, "is_moe", False):
            return
        moe = as_decoder(layer).block_sparse_moe
        if self.ep is not None:
            self.ep.attach(moe)
        elif self.data_ranks > 1:
            moe.set_stats_reducer(StatsReducer(self.dims.group("dp_ep")))

    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self.planners:
            return {}
        pl = self.planners[i]
        E, R = self.cfg.moe.num_experts, self.R
        held = torch.zeros(E, R, dtype=torch.uint8)
        for e, reps in enumerate(pl.current.replicas):
            for r in reps:
                held[e, r] = 1
        t = pl.current.predicted_time
        meta = torch.tensor([float(pl.observed), float(pl.forecast_RE is not None),
                             math.nan if t is None else float(t), float(pl.current.policy != "static")],
                            dtype=torch.float64)
        forecast = torch.zeros(R, E, dtype=torch.float64) if pl.forecast_RE is None else \
            torch.from_numpy(np.ascontiguousarray(pl.forecast_RE, dtype=np.float64))
        return {"ep_forecast": forecast, "ep_meta": meta, "ep_replicas": held}

    def layer_state_spec(self, i: int, layer: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.ep is None or not getattr(layer, "is_moe", False):
            return {}
        E, R = self.cfg.moe.num_experts, self.R
        return {"ep_forecast": ((R, E), torch.float64), "ep_meta": ((4,), torch.float64),
                "ep_replicas": ((E, R), torch.uint8)}

    def load_layer_state(self, i: int, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if not state or self.balancer is None:
            return
        state = {k: v.cpu() for k, v in state.items()}  # planner state is host data; it travelled on the device
        pl = self.balancer.add_layer(i)
        observed, has_forecast, t, planned = state["ep_meta"].tolist()
        pl.observed = int(observed)
        pl.forecast_RE = state["ep_forecast"].numpy().copy() if has_forecast else None
        held = state["ep_replicas"]
        replicas = tuple(tuple(int(r) for r in torch.nonzero(held[e]).flatten().tolist()) for e in range(held.shape[0]))
        pl.current = ExpertPlacement(num_ranks=self.R, owner=pl.owner, replicas=replicas,
                                     policy=self.cfg.planner.policy if planned else "static",
                                     predicted_time=None if math.isnan(t) else t)

    def drop_layer(self, i: int) -> None:
        if self.balancer is not None:
            self.balancer.drop_layer(i)

    def refresh(self) -> None:
        """After a migration: the stage's MoE layers changed (a plan-ahead planner is rebuilt over them)."""
        if self.ep is not None:
            self.ep.refresh()
            self._rebuild_ahead()

    # ---- checkpoints: plan-ahead's online profile, per MoE layer of this rank's tokens (extra tensors) ----
    def _first_moe(self) -> int:
        """The ordinal among the model's MoE layers of the stage's first MoE layer."""
        ids = self._moe_ids()
        return sum(self.cfg.is_moe_layer(k) for k in range(ids[0])) if ids else 0

    def ahead_tensors(self) -> dict[str, torch.Tensor]:
        """The online profile's state of the stage's MoE layers and this rank's tokens (`window_tensors`; a
        chain's ranks see the same tokens in every stage, so each layer's window is named by MoE layer ordinal
        and token shard, whichever stage held it)."""
        if self.ahead is None:
            return {}
        return self.ahead.window_tensors(self._first_moe(), self.dims.index("dp_ep"), self.data_ranks)

    def read_ahead(self, reader: CheckpointReader) -> dict[int, SavedWindow]:
        """Every MoE layer's saved online profile state of this rank's token shard (any partition), read and
        checked; `resume_ahead` installs the stage's once the saved partition is in place."""
        if self.ahead is None or not self.ahead.online:
            return {}
        from moebal.distributed.plan_ahead import read_windows

        return read_windows(reader, self.dims.index("dp_ep"))

    def resume_ahead(self, saved: dict[int, SavedWindow]) -> None:
        """Continue the stage's online profile from `read_ahead`'s windows when every rank of the stage's "ep"
        group can (`_windows_fit`: the same token shards, each held layer saved over the same steps); else it
        starts empty, as after a migration, and the stage's first rank says why."""
        a = self.ahead
        if a is None or not a.online:
            return
        group = self.dims.group("ep")

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * self.R
            dist.all_gather_object(out, obj, group=group)
            return out

        first = self._first_moe()
        say = f"stage {self.dims.index('pp')}: " if self.dims.index("dp_ep") == 0 else None
        if _windows_fit(a, saved, first, self.data_ranks, gather, say):
            a.load_window(saved, first)

    # ---- checkpoints: the run's measured coefficients and each held layer's planner, as JSON ----
    def state_dict(self) -> dict[str, Any]:
        b = self.balancer
        return {"R": self.R, "costs": None if b is None else b.costs_state(),
                "planners": {str(i): ExpertBalancer.planner_state(pl) for i, pl in self.planners.items()},
                "feedback": None if b is None else b.feedback.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any], layers: dict[int, dict[str, Any]]) -> None:
        """Restore the measured coefficients and the feedback (`state`, any rank's: they are agreed over the
        job; the feedback over the ep group) and the planner of every MoE layer held here from `layers` (layer
        id -> the saved planner of that layer, in this rank's data-parallel replica). A checkpoint of another
        expert-parallel size restores nothing: the planners start afresh on this layout's own measurement."""
        b = self.balancer
        if b is None or state.get("R") != self.R:
            return
        b.load_costs(state.get("costs"))
        for i in self._moe_ids():
            b.load_planner(i, layers.get(i))
        b.feedback.load_state_dict(state.get("feedback") or {})
        self.step = int(state.get("step", 0))


def _check_stage_ep(cfg: Config, dims: ParallelDims) -> None:
    """Refuse plan-ahead in stages without expert parallelism (`refuse_idle_plan_ahead`)."""
    refuse_idle_plan_ahead(cfg, dims.ep, dims.world_size, dims.pp)


def refuse_idle_plan_ahead(cfg: Config, ep: int, world_size: int, pp: int = 1) -> None:
    """ConfigError when `planner.plan_ahead: path` has no expert-parallel group to place experts in.

    The config check refuses `parallel.ep: 1` and `parallel.nproc: 1`; with neither set it cannot know the
    expert-parallel size, which comes from the launched ranks (world / pp, or parallel.ep), so the refusal is
    made where the size is known (the single-process trainer, `setup_parallel`, a pipeline stage) instead of
    letting plan-ahead plan nothing.
    """
    if cfg.planner.plan_ahead == "off" or cfg.moe.num_experts == 0 or ep > 1:
        return
    from moebal.errors import ConfigError

    if pp > 1:
        where = (f"this pipeline's stages have no expert-parallel group (parallel.ep resolved to {ep}: "
                 f"{world_size} ranks over parallel.pp {pp} stages{'' if cfg.parallel.ep is None else ', as set'})")
        fix = "launch more ranks per stage and set parallel.ep > 1"
    elif world_size == 1:
        where = "this run is one process, which holds every expert"
        fix = "launch at least 2 ranks (--nproc 2) with parallel.ep > 1"
    else:
        where = f"this run's expert-parallel size is {ep} ({world_size} ranks, parallel.ep {cfg.parallel.ep})"
        fix = "set parallel.ep > 1"
    raise ConfigError(f"'planner.plan_ahead: path' places experts over expert-parallel ranks, but {where}: "
                      f"{fix}, or set planner.plan_ahead off")


def _all_reduce_max(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def _planner_costs(cfg: Config, dims: ParallelDims) -> MoELayerCosts:
    """Coefficients of every stage's planners: a hardware profile, or measured on this job at start-up with a
    scratch MoE layer (a stage may hold no MoE layer yet) and agreed over the job: the slowest rates."""
    if cfg.planner.costs != "measure":
        return _profile_costs(cfg, dims)[1]
    from moebal.distributed.calibrate import measure_layer_costs
    from moebal.distributed.expert_parallel import ExpertParallelDispatcher
    from moebal.models.moe import MoELayer
    from moebal.train.precision import autocast_dtype

    tokens = cfg.data.batch_size * cfg.data.seq_len // dims.size("dp_ep")
    with torch.device("meta"):
        scratch = MoELayer.from_config(cfg)
    scratch = scratch.to_empty(device=dims.device)
    with torch.no_grad():
        for p in scratch.parameters():
            p.zero_()
    # timed in the run's precision: the dispatcher's compute dtype (its autocast)
    dispatcher = ExpertParallelDispatcher(scratch, dims, _scheduler(dims, cfg),
                                          compute_dtype=autocast_dtype(cfg, dims.device))
    measured = measure_layer_costs(dispatcher, tokens * cfg.moe.top_k)
    rates = torch.tensor([measured.expert_tokens_per_s, measured.a2a_bw(0), measured.trans_bandwidth,
                          measured.agg_bandwidth], dtype=torch.float64, device=dims.device)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # every stage plans from the same numbers
    tps, a2a, trans, agg = rates.tolist()
    return dataclasses.replace(measured, expert_tokens_per_s=tps, a2a_bandwidth=a2a, trans_bandwidth=trans,
                               agg_bandwidth=agg)


def _scheduler(dims: ParallelDims, cfg: Config) -> CommScheduler:
    """A pipeline stage's scheduler: without a thread (collectives issued and waited for in place) whose
    completion matches the device (on CUDA a host-side completion would call an NCCL collective done when it is
    only enqueued), failing a collective after `scheduler.timeout_s` as the trainer without a pipeline does.
    The gradient-sync modes do not apply: the stage sums its gradients after the step's backward passes."""
    return CommScheduler("off", rank=dims.rank, device=dims.device, timeout_s=cfg.scheduler.timeout_s)


def stage_routing(vec: torch.Tensor, num_layers: int, moe_ids: list[int], num_experts: int) -> dict[str, Any]:
    """Record fields from the chain-summed `routing_vector`s: the routing summary of every MoE layer, in layer
    order, as the trainer without a pipeline records it (`routing_record`: loads, drops, expert counts)."""
    if not moe_ids:
        return {}
    rows = vec.reshape(num_layers, -1)
    return routing_record([packed_numbers([round(float(x)) for x in rows[i]], num_experts) for i in moe_ids])


def placed_imbalance(vec: torch.Tensor, num_layers: int) -> torch.Tensor:
    """From the chain-summed `step_vector`s: each layer's rank load imbalance under the placement the step ran
    (busiest rank's computed rows over the mean; 0 for a layer without experts)."""
    return vec[2 * num_layers:3 * num_layers]


def stage_metrics(vec: torch.Tensor, num_layers: int, moe_ids: list[int]) -> dict[str, Any]:
    """Record fields from the chain-summed `step_vector`s: per MoE layer, in layer order; with plan-ahead the
    layers planned ahead and the means of their forecast figures, as the expert-parallel trainer records them."""
    L = num_layers
    after = placed_imbalance(vec, L)
    out: dict[str, Any] = {"replicas": [int(vec[i]) for i in moe_ids],
                           "rank_imbalance_before": [round(float(vec[L + i]), 4) for i in moe_ids],
                           "rank_imbalance_after": [round(float(after[i]), 4) for i in moe_ids]}
    if vec.numel() > 3 * L:
        ahead = [i for i in moe_ids if vec[3 * L + i] > 0]
        out["plan_ahead_layers"] = ahead
        accs = [{k: float(vec[(4 + n) * L + i]) for n, k in enumerate(ACCURACY_KEYS)} for i in ahead]
        out.update({f"plan_ahead_{k}": round(v, 4) for k, v in mean_accuracy(accs).items()})
    return out
