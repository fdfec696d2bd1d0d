"""Routing: gates (softmax and sigmoid top-k, group-limited choice, adaptive top-k, selection bias), capacity and
drops, balancing losses, statistics."""

from moebal.routing.balance import (
    AuxLossScope,
    assignment_counts,
    balance_sums,
    load_balancing_loss,
    pooled_balancing_loss,
    router_z_loss,
    sequence_balancing_loss,
    token_count,
    update_selection_bias,
)
from moebal.routing.capacity import capacity_keep, expert_capacity
from moebal.routing.gate import GateSpec, Routing, adaptive_take, route, select_topk
from moebal.routing.groups import GroupScore, group_limit, group_scores
from moebal.routing.stats import RoutingStats

__all__ = [
    "AuxLossScope",
    "GateSpec",
    "GroupScore",
    "Routing",
    "RoutingStats",
    "adaptive_take",
    "assignment_counts",
    "balance_sums",
    "capacity_keep",
    "expert_capacity",
    "group_limit",
    "group_scores",
    "load_balancing_loss",
    "pooled_balancing_loss",
    "route",
    "router_z_loss",
    "select_topk",
    "sequence_balancing_loss",
    "token_count",
    "update_selection_bias",
]
