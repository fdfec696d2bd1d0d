"""Expert parallelism inside pipeline stages, with Pro-Prophet placement per stage and across migrations.

Shape legend: R = ranks of a stage's "ep" group, E = experts of an MoE layer.

Layout (`moebal/distributed/groups.py`): a stage is held by dp x ep ranks ("dp_ep"); its MoE layers shard their
experts over the stage's "ep" group with the expert-parallel dispatcher and placement executor of
`moebal/distributed/expert_parallel.py` (all-to-all token path, Trans, Agg, owner-only optimizer state). A
pipeline chain is one (dp, ep) coordinate's ranks, so the chain member at stage p holds expert shard `ep` of
every MoE layer of stage p: migrating a layer along the chain moves shard e, its gradients and its AdamW
state straight to the rank of the receiving stage that must hold shard e. Nothing is resharded.

Per step, on every rank of a stage (`StageExperts`, called by the runner):
  1. before the forwards: adopt each MoE layer's placement and run Trans     (collective over "ep")
  2. after the backwards: Agg (replica gradients summed into the owners' in rank order), drop the replicas,
     all-gather each MoE layer's step counts into an R x E matrix            (collective over "ep")
     and step the layer's `ExpertPlanner` (Pro-Prophet by default): the placement of the next step.
Each layer's planner lives with the layer: its state (forecast, current placement) migrates with it
(`layer_state`), so a run with migrations places experts exactly as the run without and its losses are the
same bit for bit. Every rank of an ep group plans from the same gathered counts and the same coefficients,
which are agreed over the whole job at start-up (the slowest figure), so a layer is planned alike on
whichever stage it sits.

Routing statistics for the load-balancing loss are summed over the stage's ranks ("dp_ep": a differentiable
all-reduce, `StatsReducer`), so each micro-batch's auxiliary loss is that of the micro-batch formed by every
rank's rows (the single-process loss of that global micro-batch); the engine scales its backward by 1/ranks
because the gradient sync sums over them. This also holds with ep = 1 and data-parallel replicas.

Devices: the count all-gather and `shard_sum` run on the compute device (NCCL on CUDA; one read of all
layers' counts per step, through `moebal.sync.to_host`); the planner's state is host data (CPU tensors when it
migrates, moved to the compute device for the transfer by `migrate.py` and back here).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moebal.config import Config
from moebal.distributed.expert_parallel import ExpertParallel, StatsReducer
from moebal.distributed.groups import ParallelDims
from moebal.planner.perf import MoELayerCosts
from moebal.planner.placement import ExpertPlanner, placement_metrics
from moebal.planner.plan import ExpertPlacement
from moebal.scheduler import CommScheduler
from moebal.sync import to_host

__all__ = ["StageExperts"]


class StageExperts:
    """The MoE layers of one pipeline stage under expert parallelism (see the module docstring)."""

    def __init__(self, stage: nn.Module, dims: ParallelDims, cfg: Config) -> None:
        self.stage, self.dims, self.cfg = stage, dims, cfg
        self.R = dims.ep
        self.data_ranks = dims.size("dp_ep")
        from moebal.train.precision import autocast_dtype

        dtype = autocast_dtype(cfg, dims.device)  # replicas travel in the compute dtype
        self.ep: ExpertParallel | None = (ExpertParallel(stage, dims, _scheduler(dims), compute_dtype=dtype)
                                          if self.R > 1 else None)
        if self.ep is None:
            for i in stage.layer_ids:
                self.prepare_layer(i, stage.layer(i))
        self.costs: MoELayerCosts | None = None
        self.planners: dict[int, ExpertPlanner] = {}
        self.metrics: dict[int, dict[str, float]] = {}
        if self.ep is not None:
            self.costs = _planner_costs(cfg, dims)
            for i in self._moe_ids():
                self.planners[i] = self._new_planner()

    @property
    def sharded(self) -> bool:
        return self.ep is not None

    def _moe_ids(self) -> list[int]:
        return [i for i in self.stage.layer_ids if self.stage.layer(i).is_moe]

    def _new_planner(self) -> ExpertPlanner:
        p = self.cfg.planner
        extra = {"overlap": True} if p.overlap and p.policy == "prophet" else {}
        return ExpertPlanner(self.cfg.moe.num_experts, self.R, p.policy, self.costs, every=p.every, ema=p.ema,
                             hysteresis=p.hysteresis, **extra)

    # ---- the step ----
    def before_step(self) -> None:
        """Trans: adopt every MoE layer's placement (collective over the ep group)."""
        if self.ep is not None:
            self.ep.apply([self.planners[i].current for i in self._moe_ids()])

    def after_backward(self) -> None:
        """Agg: replica gradients back to their owners, the replicas dropped (nothing may run on them); then
        observe the step's counts and plan the next step's placements (collective over the ep group)."""
        if self.ep is not None:
            self.ep.aggregate()
            self.ep.release()
        self._observe_and_plan()

    def _observe_and_plan(self) -> None:
        if self.ep is None:
            for i in self._moe_ids():
                self.stage.layer(i).block_sparse_moe.take_stats()  # the step's statistics: nobody plans on them
            return
        self.metrics = {}
        ids = self._moe_ids()
        if not ids:  # every rank of the ep group holds the same layers: none of them gathers
            return
        # one all-gather of every layer's counts on the compute device, one host read for the planners
        counts_NE = torch.stack([self.stage.layer(i).block_sparse_moe.take_stats().counts_E for i in ids])
        gathered = [torch.empty_like(counts_NE) for _ in range(self.R)]
        dist.all_gather(gathered, counts_NE, group=self.dims.group("ep"))
        counts_RNE = np.asarray(to_host(torch.stack(gathered), "placement counts"), dtype=np.float64)
        for n, i in enumerate(ids):
            counts_RE = np.ascontiguousarray(counts_RNE[:, n])
            planner = self.planners[i]
            used = planner.current
            self.metrics[i] = placement_metrics(counts_RE, used, self.costs)
            planner.step(counts_RE)

    def step_vector(self, num_layers: int) -> torch.Tensor:
        """Per layer: replicas used, rank load imbalance before and after placement (0 where not held)."""
        v = torch.zeros(3 * num_layers, dtype=torch.float64)
        for i, m in self.metrics.items():
            v[i], v[num_layers + i], v[2 * num_layers + i] = m["replicas"], m["imbalance_before"], m["imbalance_after"]
        return v

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
        moe = layer.block_sparse_moe
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
        if not state:
            return
        state = {k: v.cpu() for k, v in state.items()}  # planner state is host data; it travelled on the device
        pl = self._new_planner()
        observed, has_forecast, t, planned = state["ep_meta"].tolist()
        pl.observed = int(observed)
        pl.forecast_RE = state["ep_forecast"].numpy().copy() if has_forecast else None
        held = state["ep_replicas"]
        replicas = tuple(tuple(int(r) for r in torch.nonzero(held[e]).flatten().tolist()) for e in range(held.shape[0]))
        pl.current = ExpertPlacement(num_ranks=self.R, owner=pl.owner, replicas=replicas,
                                     policy=self.cfg.planner.policy if planned else "static",
                                     predicted_time=None if math.isnan(t) else t)
        self.planners[i] = pl

    def drop_layer(self, i: int) -> None:
        self.planners.pop(i, None)
        self.metrics.pop(i, None)

    def refresh(self) -> None:
        """After a migration: the stage's MoE layers changed."""
        if self.ep is not None:
            self.ep.refresh()

    # ---- checkpoints: the run's measured coefficients and each held layer's planner, as JSON ----
    def state_dict(self) -> dict[str, Any]:
        from moebal.distributed.calibrate import costs_to_dict

        measured = self.costs is not None and self.cfg.planner.costs == "measure"
        return {"R": self.R, "costs": costs_to_dict(self.costs) if measured else None,
                "planners": {str(i): {"forecast": None if pl.forecast_RE is None else pl.forecast_RE.tolist(),
                                      "observed": pl.observed, "current": pl.current.to_dict()}
                             for i, pl in self.planners.items()}}

    def load_state_dict(self, state: dict[str, Any], layers: dict[int, dict[str, Any]]) -> None:
        """Restore the measured coefficients (`state`, any rank's: they are agreed over the job) and the planner
        of every MoE layer held here from `layers` (layer id -> the saved planner of that layer, in this
        rank's data-parallel replica). A checkpoint of another expert-parallel size restores nothing: the
        planners start afresh on this layout's own measurement."""
        if self.ep is None or state.get("R") != self.R:
            return
        from moebal.distributed.calibrate import costs_from_dict

        if state.get("costs"):
            self.costs = costs_from_dict(state["costs"])
        for i in self._moe_ids():
            pl = self._new_planner()
            saved = layers.get(i)
            if saved is not None:
                pl.forecast_RE = None if saved["forecast"] is None else np.asarray(saved["forecast"],
                                                                                   dtype=np.float64)
                pl.observed = int(saved["observed"])
                pl.current = ExpertPlacement.from_dict(saved["current"])
            self.planners[i] = pl


def _planner_costs(cfg: Config, dims: ParallelDims) -> MoELayerCosts:
    """Coefficients of every stage's planners: a hardware profile, or measured on this job at start-up with a
    scratch MoE layer (a stage may hold no MoE layer yet) and agreed over the job: the slowest rates."""
    tokens = cfg.data.batch_size * cfg.data.seq_len // dims.size("dp_ep")
    if cfg.planner.costs != "measure":
        from moebal.planner.cost import CostModel, ModelShape

        return CostModel(cfg.planner.costs).moe_layer_costs(ModelShape.from_config(cfg), dims.ranks_of("ep"), tokens,
                                                           cfg.data.seq_len)
    from moebal.distributed.calibrate import measure_layer_costs
    from moebal.distributed.expert_parallel import ExpertParallelDispatcher
    from moebal.models.moe import MoELayer
    from moebal.train.precision import autocast_dtype

    with torch.device("meta"):
        scratch = MoELayer.from_config(cfg)
    scratch = scratch.to_empty(device=dims.device)
    with torch.no_grad():
        for p in scratch.parameters():
            p.zero_()
    # timed in the run's precision: the dispatcher's compute dtype (its autocast)
    dispatcher = ExpertParallelDispatcher(scratch, dims, _scheduler(dims),
                                          compute_dtype=autocast_dtype(cfg, dims.device))
    measured = measure_layer_costs(dispatcher, tokens * cfg.moe.top_k)
    rates = torch.tensor([measured.expert_tokens_per_s, measured.a2a_bw(0), measured.trans_bandwidth,
                          measured.agg_bandwidth], dtype=torch.float64, device=dims.device)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # every stage plans from the same numbers
    tps, a2a, trans, agg = rates.tolist()
    return dataclasses.replace(measured, expert_tokens_per_s=tps, a2a_bandwidth=a2a, trans_bandwidth=trans,
                               agg_bandwidth=agg)


def _scheduler(dims: ParallelDims) -> CommScheduler:
    """A scheduler without a thread (collectives issued and waited for in place) whose completion matches the
    device: on CUDA a host-side completion would call an NCCL collective done when it is only enqueued."""
    return CommScheduler("off", rank=dims.rank, device=dims.device)


def stage_metrics(vec: torch.Tensor, num_layers: int, moe_ids: list[int]) -> dict[str, Any]:
    """Record fields from the chain-summed `step_vector`s: per MoE layer, in layer order."""
    L = num_layers
    return {"replicas": [int(vec[i]) for i in moe_ids],
            "rank_imbalance_before": [round(float(vec[L + i]), 4) for i in moe_ids],
            "rank_imbalance_after": [round(float(vec[2 * L + i]), 4) for i in moe_ids]}
