"""Planners: pure functions (stats, cost model, current plan) -> frozen plan. No torch.distributed here."""

from moebal.planner.plan import ExpertPlacement, default_owners

__all__ = ["ExpertPlacement", "default_owners"]
