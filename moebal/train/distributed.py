"""What the trainer needs to know about the other ranks, and the expert-parallel balancing hook.

`RunContext` answers the trainer's few distributed questions (which rows of the global batch are mine, the
mean of a number over ranks, the global gradient norm, am I the rank that writes files) for a single process
and for any data x expert-parallel layout, so the trainer never branches on `torch.distributed` itself.

`ExpertParallelHook` is the per-step observe -> plan -> apply loop of Pro-Prophet on a real job:
  after the step     observe: all-gather every MoE layer's per-expert counts into R x E matrices
                     plan: one `ExpertPlanner` per layer forecasts step j+1 from step j (optionally EMA'd)
  before the step    apply: adopt the placements and run Trans (owners send replica parameters)
  after backward     Agg (replica gradients back to their owners), then gradient sync
Every rank runs the same planners on the same all-gathered counts and the same measured coefficients, so
they agree on the plan without a broadcast. The coefficients are measured once per run and travel in the
checkpoints: a resumed run plans from the same figures, hence the same placements, as the uninterrupted one
(a re-measurement would differ and change replicas, so the summation order, so the last bits of the loss).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.config import Config
from moebal.dist.comm import sum_gradients
from moebal.dist.expert_parallel import ExpertParallel, is_expert_param
from moebal.dist.groups import ParallelDims
from moebal.errors import ConfigError
from moebal.planner.experts import ExpertPlanner, placement_metrics
from moebal.planner.plan import ExpertPlacement
from moebal.routing import RoutingStats
from moebal.train.checkpoint import Checkpointer
from moebal.train.hooks import Hook
from moebal.train.metrics import MetricsLog

if TYPE_CHECKING:
    from moebal.data import Batch
    from moebal.train.trainer import Trainer

__all__ = ["ExpertParallelHook", "RunContext"]


class RunContext:
    """The trainer's view of the job: one process (the default) or `dims.world_size` ranks."""

    def __init__(self, dims: ParallelDims | None = None) -> None:
        self.dims = dims or ParallelDims(world_size=1, rank=0)

    @property
    def distributed(self) -> bool:
        return self.dims.world_size > 1

    @property
    def is_main(self) -> bool:
        """The rank that writes metrics, plans, the dashboard and the progress display."""
        return self.dims.rank == 0

    @property
    def data_ranks(self) -> int:
        """Ranks that split one global batch between them (every rank of a pipeline stage)."""
        return self.dims.size("dp_ep")

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.data_ranks:
            raise ConfigError(f"data.batch_size ({batch_size}) is not divisible by the {self.data_ranks} ranks that "
                              f"share a batch: choose a batch size that is a multiple of {self.data_ranks}")

    def shard(self, batch: Batch) -> tuple[Batch, float]:
        """My rows of the global batch, and the factor that makes my mean-per-token loss a share of the global
        mean-per-token loss once gradients are averaged over ranks (1.0 when every rank has as many tokens)."""
        if not self.distributed:
            return batch, 1.0
        from moebal.data import Batch

        n, i = self.data_ranks, self.dims.index("dp_ep")
        rows = batch.ids_BT.shape[0] // n
        ids, labels = batch.ids_BT[i * rows:(i + 1) * rows], batch.labels_BT[i * rows:(i + 1) * rows]
        mine = int((labels != -100).sum())
        scale = mine * n / max(batch.n_tokens, 1)
        return Batch(ids, labels, mine), scale

    def mean(self, value: float) -> float:
        """Mean of a number over the ranks sharing a batch."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.dims.group("dp_ep"))
        return float(t.item()) / self.data_ranks

    def sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.dims.group("dp_ep"))
        return t.tolist()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: replicated gradients count once, expert shards are
        summed over the expert-parallel group (each rank holds different experts)."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not self.distributed:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        dense = [p.grad.float().square().sum() for p in params if not is_expert_param(p)]
        expert = [p.grad.float().square().sum() for p in params if is_expert_param(p)]
        sq_dense = torch.stack(dense).sum() if dense else torch.zeros(())
        sq_expert = torch.stack(expert).sum() if expert else torch.zeros(())
        if self.dims.size("ep") > 1:
            dist.all_reduce(sq_expert, group=self.dims.group("ep"))
        total = (sq_dense + sq_expert).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return total

    # ---- checkpoints (moebal/train/checkpoint.py) ----
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON-like data), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(out, obj)
        return out

    def layout(self) -> dict[str, int]:
        """The parallel layout, as checkpoints record it (a resume under another one reshards)."""
        d = self.dims
        return {"world_size": d.world_size, "pp": d.pp, "dp": d.dp, "ep": d.ep}

    def checkpointer(self, run_dir: Path, keep: int, background: bool) -> Checkpointer:
        """This rank's checkpoint writer. Every logical tensor is written once: dense ones by the first rank
        of the stage's data x expert group, experts by the first rank of their data-parallel group.
        Collective (the ranks agree on a session name for their temporary directories)."""
        session = self.gather(f"{int(time.time())}-{os.getpid()}")[0]
        return Checkpointer(run_dir, rank=self.dims.rank, ranks=range(self.dims.world_size),
                            write_dense=self.dims.index("dp_ep") == 0, write_experts=self.dims.index("dp") == 0,
                            keep=keep, background=background, session=session)


class ExpertParallelHook(Hook):
    """Pro-Prophet's observe -> plan -> apply loop on a live expert-parallel job (see the module docstring)."""

    def __init__(self, ep: ExpertParallel, cfg: Config, costs: Any, ctx: RunContext,
                 measure: Callable[[], Any] | None = None) -> None:
        """`costs`: the planner's coefficients (from a hardware profile), or None with `measure`, which measures
        them on the job at the start of training unless a checkpoint brought the figures of the run's first
        measurement (live figures vary run to run, and placements follow them)."""
        self.ep, self.ctx, self.costs, self._measure = ep, ctx, costs, measure
        p = cfg.planner
        E, R = cfg.moe.num_experts, ep.dims.size("ep")
        self.planners = [ExpertPlanner(E, R, p.policy, costs, every=p.every, ema=p.ema, hysteresis=p.hysteresis,
                                       **({"overlap": True} if p.overlap and p.policy == "prophet" else {}))
                         for _ in ep.layers]
        self.placements: list[ExpertPlacement] = [pl.current for pl in self.planners]
        self._log = None

    def _set_costs(self, costs: Any) -> None:
        self.costs = costs
        for pl in self.planners:
            pl.cost = costs

    @property
    def name(self) -> str:
        return "expert_parallel"

    def on_start(self, trainer: Trainer) -> None:
        if self.costs is None:
            assert self._measure is not None, "ExpertParallelHook needs costs or a way to measure them"
            self._set_costs(self._measure())  # collective: every rank of the EP group measures together
        if self.ctx.is_main:
            path = trainer.run_dir / "plans.jsonl"
            MetricsLog.truncate_after(path, trainer.step)  # a resumed run re-plans the steps after its checkpoint
            self._log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_end

    def before_step(self, trainer: Trainer, step: int) -> None:
        self.ep.apply(self.placements)  # Trans

    def after_backward(self, trainer: Trainer, step: int) -> None:
        self.ep.aggregate()  # Agg, before the optimizer step
        self.ep.sync_gradients()

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        """Keep each rank's counts (the planner's R x E matrix) and return the counts summed over ranks."""
        group, R = self.ep.dims.group("ep"), self.ep.dims.size("ep")
        self._counts_RE = []
        for s in stats:
            gathered = [torch.zeros_like(s.counts_E) for _ in range(R)]
            dist.all_gather(gathered, s.counts_E, group=group)
            self._counts_RE.append(torch.stack(gathered).cpu().numpy().astype(np.float64))
        return sum_stats(stats, self.ep.dims.group("dp_ep"))

    def after_step(self, trainer: Trainer, step: int, stats: list[RoutingStats], record: dict[str, Any]) -> None:
        self.ep.release()  # replicas hold pre-update weights; validation and the next Trans must not see them
        used = self.placements
        metrics = [placement_metrics(c, p, self.costs) for c, p in zip(self._counts_RE, used)]
        self.placements = [pl.step(c) for pl, c in zip(self.planners, self._counts_RE)]
        record["rank_imbalance_before"] = [round(m["imbalance_before"], 4) for m in metrics]
        record["rank_imbalance_after"] = [round(m["imbalance_after"], 4) for m in metrics]
        record["replicas"] = [p.num_replicas for p in used]
        record["trans_bytes"] = int(sum(m["trans_bytes"] for m in metrics))
        record["a2a_bytes"] = int(sum(m["a2a_bytes"] for m in metrics))
        record["plan_ms"] = round(1e3 * sum(pl.last.get("plan_s", 0.0) for pl in self.planners), 3)
        if self._log is not None:
            line = {"step": step, "counts": [c.astype(int).tolist() for c in self._counts_RE],
                    "used": [p.to_dict() for p in used], "next": [p.to_dict() for p in self.placements],
                    "metrics": metrics}
            self._log.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._log.flush()

    def on_end(self, trainer: Trainer) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def state_dict(self) -> dict[str, Any]:
        """Planner forecasts, the placements of the next step and measured coefficients, so a resumed run plans
        what the uninterrupted run would have (placements change only summation order, but resume is bitwise)."""
        from moebal.dist.calibrate import costs_to_dict

        return {"placements": [p.to_dict() for p in self.placements],
                "planners": [{"forecast": None if pl.forecast_RE is None else pl.forecast_RE.tolist(),
                              "observed": pl.observed, "current": pl.current.to_dict()} for pl in self.planners],
                "measured_costs": costs_to_dict(self.costs) if self._measure is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        from moebal.dist.calibrate import costs_from_dict

        placements = [ExpertPlacement.from_dict(d) for d in state["placements"]]
        if len(placements) != len(self.planners) or any(p.num_ranks != self.ep.dims.size("ep") for p in placements):
            return  # a checkpoint of another expert-parallel size: plan afresh (and measure this layout's costs)
        self.placements = placements
        for pl, s in zip(self.planners, state["planners"]):
            pl.forecast_RE = None if s["forecast"] is None else np.asarray(s["forecast"], dtype=np.float64)
            pl.observed = int(s["observed"])
            pl.current = ExpertPlacement.from_dict(s["current"])
        if self._measure is not None and state.get("measured_costs"):
            self._set_costs(costs_from_dict(state["measured_costs"]))  # no re-measurement: the same plans


def setup_parallel(cfg: Config, load_weights: bool = True) -> tuple[RunContext, torch.nn.Module, list[Hook]]:
    """Join the job described by the torchrun environment and build this rank's model and hooks.

    The full model is built on every rank from the run's seed (or read from `hf.init_from`, unless
    `load_weights` is false because a checkpoint will overwrite it), so it equals the single-process model;
    then expert parallelism keeps this rank's experts; the planner's coefficients come from `planner.costs`.
    """
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = cfg.parallel.pp
    if pp != 1:
        raise ConfigError("parallel.pp > 1 runs the pipeline engine (moebal.pipeline); this entry point builds "
                          "data and expert parallelism only")
    ep = cfg.parallel.ep or world
    if cfg.moe.num_experts and cfg.moe.num_experts % ep:
        raise ConfigError(f"moe.num_experts ({cfg.moe.num_experts}) is not divisible by the expert-parallel size "
                          f"{ep}: set parallel.ep (--ep) to a divisor of it")
    if cfg.moe.num_experts == 0:
        ep = 1
    dims = ParallelDims.from_env(ep=ep, pp=pp).init()
    ctx = RunContext(dims)
    seed_everything(cfg.train.seed)
    model = build_model(cfg, load_weights=load_weights).to(dims.device)
    hooks: list[Hook] = []
    if dims.distributed and ep > 1 and cfg.moe.num_experts:
        expert_parallel = ExpertParallel(model, dims)
        hooks.append(_expert_parallel_hook(cfg, expert_parallel, dims, ctx))
    elif dims.distributed:
        hooks.append(DataParallelHook(dims))
    return ctx, model, hooks


def _expert_parallel_hook(cfg: Config, ep: ExpertParallel, dims: ParallelDims, ctx: RunContext) -> ExpertParallelHook:
    """The hook with its planner coefficients: from a hardware profile now, or measured on the job when
    training starts (`planner.costs: measure`) unless a resumed checkpoint holds the run's measurement."""
    tokens = cfg.data.batch_size * cfg.data.seq_len // dims.size("dp_ep")
    if cfg.planner.costs == "measure":
        from moebal.dist.calibrate import measure_layer_costs

        return ExpertParallelHook(ep, cfg, None, ctx,
                                  measure=lambda: measure_layer_costs(ep.dispatchers[0], tokens * cfg.moe.top_k))
    from moebal.planner.cost import CostModel, ModelShape

    costs = CostModel(cfg.planner.costs).moe_layer_costs(ModelShape.from_config(cfg), dims.ranks_of("ep"), tokens,
                                                        cfg.data.seq_len)
    return ExpertParallelHook(ep, cfg, costs, ctx)


class DataParallelHook(Hook):
    """Plain data parallelism (a dense model, or experts replicated): average every gradient over the ranks."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims

    def after_backward(self, trainer: Trainer, step: int) -> None:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        sum_gradients(params, self.dims.group("dp_ep"), self.dims.size("dp_ep"))

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        return sum_stats(stats, self.dims.group("dp_ep"))


def sum_stats(stats: list[RoutingStats], group: Any) -> list[RoutingStats]:
    """Routing statistics summed over the ranks of `group` (copies; the inputs stay local)."""
    out = []
    for s in stats:
        t = s.clone()
        for x in (t.counts_E, t.routed_E, t.used_K, t.tokens):
            dist.all_reduce(x, group=group)
        out.append(t)
    return out
