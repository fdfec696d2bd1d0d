"""Planners: pure functions (stats, cost model, current plan) -> frozen plan. No torch.distributed here."""

from moebal.planner.perf import FasterMoECosts, LayerTime, MoELayerCosts, evaluate
from moebal.planner.placement import (
    DEFAULT_COSTS,
    POLICIES,
    ExpertPlanner,
    placement_metrics,
    plan_experts,
)
from moebal.planner.plan import ExpertPlacement, default_owners

__all__ = [
    "DEFAULT_COSTS",
    "POLICIES",
    "ExpertPlacement",
    "ExpertPlanner",
    "FasterMoECosts",
    "LayerTime",
    "MoELayerCosts",
    "default_owners",
    "evaluate",
    "placement_metrics",
    "plan_experts",
]
