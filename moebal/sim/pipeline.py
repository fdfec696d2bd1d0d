"""Pipeline-only simulation over per-layer costs (one rank per stage): GPipe or 1F1B, on the same engine.

Used for stage-partition studies (DynMo's bubble ratios) where each layer's forward and backward time is known
and the details inside a layer do not matter. Shape legend: L = layers, P = stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.cost import CostModel
from moebal.planner.hardware import GemmSpec, HardwareProfile, LinkSpec
from moebal.sim.engine import Engine
from moebal.sim.program import SCHEDULES, pipeline_order

__all__ = ["PipelineResult", "simulate_pipeline"]


@dataclass(frozen=True)
class PipelineResult:
    iteration_time_s: float
    bubble_ratio: float
    """Idle share of the stages' compute, mean over stages."""
    busy_s: tuple[float, ...]


def _unit_profile(p2p_s: float) -> HardwareProfile:
    # A link whose transfer of one byte takes p2p_s seconds: p2p ops carry one byte.
    link = LinkSpec(bandwidth=1.0 / p2p_s if p2p_s > 0 else 1e30, latency_s=0.0)
    return HardwareProfile(name="pipeline-unit", gpus_per_node=1, flops={"fp32": 1.0},
                           gemm=GemmSpec(max_efficiency=1.0, half_dim=0.0), memory_bandwidth=1.0, memory_bytes=1.0,
                           intra=link, inter=link)


def simulate_pipeline(layer_fwd_s: Sequence[float], layer_bwd_s: Sequence[float], stage_layers: Sequence[int],
                      micro_batches: int, schedule: str = "1f1b", p2p_s: float = 0.0) -> PipelineResult:
    """Iteration time and bubble ratio of a pipeline whose stage s runs layers of `stage_layers[s]` in order;
    each micro-batch costs the sum of its layers' times; activations take `p2p_s` to reach the next stage."""
    f_L, b_L = np.asarray(layer_fwd_s, dtype=np.float64), np.asarray(layer_bwd_s, dtype=np.float64)
    if f_L.shape != b_L.shape or sum(stage_layers) != f_L.shape[0] or min(stage_layers) < 1:
        raise ConfigError(f"stage_layers {list(stage_layers)} must be >= 1 each and sum to the {f_L.shape[0]} layers")
    if schedule not in SCHEDULES or micro_batches < 1:
        raise ConfigError(f"schedule must be one of {SCHEDULES} and micro_batches >= 1")
    P = len(stage_layers)
    edges = np.concatenate([[0], np.cumsum(stage_layers)])
    fwd = [float(f_L[edges[s]:edges[s + 1]].sum()) for s in range(P)]
    bwd = [float(b_L[edges[s]:edges[s + 1]].sum()) for s in range(P)]
    cost = CostModel(_unit_profile(p2p_s), "fp32")
    topo = cost.topology(P)
    eng = Engine(topo)
    ops: dict[tuple[int, str, int], int] = {}
    for s in range(P):
        for kind, j in pipeline_order(schedule, s, P, micro_batches):
            ops[(s, kind, j)] = eng.compute(s, "compute", fwd[s] if kind == "F" else bwd[s], f"{kind}{j}",
                                            deps=[ops[(s, "F", j)]] if kind == "B" else ())
    for s in range(P - 1):
        for j in range(micro_batches):
            f = eng.collective(cost.p2p(topo, s, s + 1, 1.0), ["fwd_out", "fwd_in"], f"F{j} send",
                               deps=[[ops[(s, "F", j)]], []])
            eng.add_dep(ops[(s + 1, "F", j)], f[1])
            b = eng.collective(cost.p2p(topo, s + 1, s, 1.0), ["bwd_out", "bwd_in"], f"B{j} send",
                               deps=[[ops[(s + 1, "B", j)]], []])
            eng.add_dep(ops[(s, "B", j)], b[1])
    res = eng.run()
    T = res.makespan
    busy = tuple(micro_batches * (fwd[s] + bwd[s]) for s in range(P))
    return PipelineResult(iteration_time_s=T, bubble_ratio=1.0 - float(np.mean(busy)) / T if T > 0 else 0.0,
                          busy_s=busy)
