"""Simulate one training iteration: routing -> placements (a policy) -> op graph -> engine -> figures.

Shape legend: L = layers, G = EP groups of a stage, R = ranks of one EP group, E = experts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.cost import CostModel, ModelShape
from moebal.planner.plan import ExpertPlacement
from moebal.sim.engine import EngineResult
from moebal.sim.program import SimSpec, build_program, uniform_stages

__all__ = ["POLICIES", "SimResult", "plan_placements", "simulate", "write_chrome_trace"]

POLICIES = ("static", "fastermoe", "prophet")


@dataclass
class SimResult:
    """Figures of one simulated iteration (seconds unless named otherwise)."""

    iteration_time_s: float
    num_ranks: int
    busy_s: np.ndarray
    """Per rank: time its compute stream is busy."""
    comm_s: dict[str, float]
    """Mean per rank of time spent inside each kind of communication op (a2a, allreduce, trans, agg, p2p, and
    stats: the balancing statistics' all-reduce over an expert-parallel group)."""
    bytes_by_link_class: dict[str, float]
    max_link_bytes: float
    placements_summary: dict[str, Any]
    engine: EngineResult | None = field(default=None, repr=False)
    meta: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def idle_s(self) -> np.ndarray:
        return self.iteration_time_s - self.busy_s

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the compute streams, mean over ranks (pipeline bubbles, communication waits and
        stragglers alike; for equal stages without communication it is (p-1)/(m+p-1))."""
        if self.iteration_time_s <= 0:
            return 0.0
        return float(1.0 - self.busy_s.mean() / self.iteration_time_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration_time_s": self.iteration_time_s,
            "num_ranks": self.num_ranks,
            "bubble_ratio": self.bubble_ratio,
            "busy_s": {"mean": float(self.busy_s.mean()), "min": float(self.busy_s.min()),
                       "max": float(self.busy_s.max())},
            "idle_s": {"mean": float(self.idle_s.mean()), "min": float(self.idle_s.min()),
                       "max": float(self.idle_s.max())},
            "comm_s": self.comm_s,
            "bytes_by_link_class": self.bytes_by_link_class,
            "max_link_bytes": self.max_link_bytes,
            "placements": self.placements_summary,
            "meta": self.meta,
            "simulate_wall_s": self.wall_s,
        }


def plan_placements(policy: str, cost: CostModel, shape: ModelShape, spec: SimSpec, predicted: np.ndarray,
                    stages: Sequence[int], per_link: bool = True,
                    **options: Any) -> list[list[ExpertPlacement]] | None:
    """Per MoE layer and EP group, the placement `policy` chooses from `predicted` counts [L, G, R, E].
    `per_link`: moebal's planner, which prices the exchanges, Trans and Agg on the group's links; False: the
    paper's eq. 1-8 (one bandwidth per exchange, one transfer time per replicated expert), Pro-Prophet's own."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if shape.num_experts == 0:
        return None
    lay = spec.layout
    static = ExpertPlacement.static(shape.num_experts, lay.ep)
    if policy == "static" or lay.ep == 1:
        return [[static] * lay.groups for _ in range(shape.n_layers)]
    from moebal.planner.placement import plan_experts

    first = np.concatenate([[0], np.cumsum(stages)])
    M = spec.micro_batches
    tokens = spec.micro_batch_size * spec.seq_len  # one micro-batch's: the rows the program's expert GEMMs run
    out: list[list[ExpertPlacement]] = []
    costs_by_stage: dict[int, Any] = {}
    for layer in range(shape.n_layers):
        if not shape.is_moe(layer):
            out.append([static] * lay.groups)
            continue
        s = int(np.searchsorted(first, layer, side="right") - 1)
        if s not in costs_by_stage:
            # the first group's links price every group of the stage (the groups are laid out alike); Trans and
            # Agg as the program sends them
            layer_costs = cost.moe_layer_costs(shape, lay.ep_groups(s)[0].tolist(), tokens, spec.seq_len,
                                               num_ranks=lay.ranks, trans_algorithm=spec.trans_algorithm)
            # the expert rate at one micro-batch's rows, the non-MoE work of all M (the counts are the step's); the
            # program issues Trans in the first micro-batch's forward and Agg in the last one's backward
            costs_by_stage[s] = dataclasses.replace(layer_costs, overlap_share=1.0 / M,
                                                    nonmoe_fwd_s=layer_costs.nonmoe_fwd_s * M,
                                                    nonmoe_bwd_s=layer_costs.nonmoe_bwd_s * M,
                                                    links=layer_costs.links if per_link else None)
        out.append([plan_experts(predicted[layer, g], policy, costs_by_stage[s], owner=static.owner, **options)
                    for g in range(lay.groups)])
    return out


def simulate(shape: ModelShape, cost: CostModel, spec: SimSpec, counts: np.ndarray | None,
             placements: Sequence[Sequence[ExpertPlacement]] | None = None, keep_engine: bool = True) -> SimResult:
    """Run one iteration; counts [L, G, R, E] (None for a dense model), placements[l][g] (None: static)."""
    t0 = time.perf_counter()
    topo = cost.topology(spec.layout.ranks)
    eng = build_program(cost, shape, spec, counts, placements, topo)
    res = eng.run()
    busy = np.zeros(res.num_ranks)
    comp = ~res.op_is_comm
    np.add.at(busy, res.op_rank[comp], (res.op_end - res.op_start)[comp])
    comm: dict[str, float] = {}
    cats = np.asarray(res.op_cat)
    for cat in sorted(set(cats[res.op_is_comm].tolist())):
        sel = res.op_is_comm & (cats == cat)
        comm[cat] = float((res.op_end - res.op_start)[sel].sum() / res.num_ranks)
    by_class = {label: float(res.link_bytes[lo:hi].sum()) for lo, hi, label in topo.link_classes()}
    summary = _placement_summary(placements)
    stages = spec.stage_layers or uniform_stages(shape.n_layers, spec.layout.pp)
    meta = {"ranks": spec.layout.ranks, "pp": spec.layout.pp, "ep": spec.layout.ep, "dp": spec.layout.dp,
            "micro_batches": spec.micro_batches, "micro_batch_size": spec.micro_batch_size, "seq_len": spec.seq_len,
            "schedule": spec.schedule, "moe_schedule": spec.moe_schedule, "stage_layers": list(stages),
            "profile": cost.profile.name, "dtype": cost.dtype, "ops": int(res.op_rank.size)}
    return SimResult(iteration_time_s=res.makespan, num_ranks=res.num_ranks, busy_s=busy, comm_s=comm,
                     bytes_by_link_class=by_class, max_link_bytes=float(res.link_bytes.max(initial=0.0)),
                     placements_summary=summary, engine=res if keep_engine else None, meta=meta,
                     wall_s=time.perf_counter() - t0)


def _placement_summary(placements: Sequence[Sequence[ExpertPlacement]] | None) -> dict[str, Any]:
    if not placements:
        return {"replicas": 0}
    reps = [p.num_replicas for layer in placements for p in layer]
    return {"replicas": int(sum(reps)), "max_replicas_per_layer_group": int(max(reps, default=0)),
            "policies": sorted({p.policy for layer in placements for p in layer})}


def write_chrome_trace(res: EngineResult, path: str | Path, ranks: Sequence[int] | None = None) -> int:
    """Chrome trace (Perfetto) JSON: one process track per rank, one thread per stream; returns events written."""
    keep = np.ones(res.op_rank.shape[0], dtype=bool) if ranks is None else np.isin(res.op_rank, list(ranks))
    shown = sorted(set(res.op_rank[keep].tolist())) if ranks is not None else list(range(res.num_ranks))
    events: list[dict[str, Any]] = []
    for r in shown:
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for t, s in enumerate(res.streams):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": s}})
    idx = np.nonzero(keep)[0]
    start_us, dur_us = res.op_start[idx] * 1e6, (res.op_end[idx] - res.op_start[idx]) * 1e6
    for i, o in enumerate(idx.tolist()):
        events.append({"name": res.op_name[o], "cat": res.op_cat[o], "ph": "X", "pid": int(res.op_rank[o]),
                       "tid": int(res.op_stream[o]), "ts": round(float(start_us[i]), 3),
                       "dur": round(float(dur_us[i]), 3)})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
