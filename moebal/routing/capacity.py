"""Expert capacity and drop policies.

Shape legend: T tokens, E experts, K = top_k, N = K * T assignments (flattened choice-major: a = j * T + t).
"""

from __future__ import annotations

import math

import torch

from moebal.sync import count_ids


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Assignments one expert may keep: ceil(factor * tokens * k / E) (Switch/GShard, counted locally)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(indices_TK: torch.Tensor, taken_TK: torch.Tensor | None, priority_TK: torch.Tensor,
                  num_experts: int, capacity: int, policy: str) -> torch.Tensor:
    """bool kept_TK: which taken assignments fit in their expert's `capacity` slots.

    `position`: earlier choice levels first, then earlier tokens (GShard/Tutel: every first choice is
    placed before any second choice). `probs`: higher priority (gate probability) first, ties broken by
    that same choice-level-then-position order (batch-prioritised routing, V-MoE).
    Not-taken assignments are never kept and take no slot.
    """
    T, K = indices_TK.shape
    experts_N = indices_TK.t().reshape(-1)
    if taken_TK is not None:
        experts_N = torch.where(taken_TK.t().reshape(-1), experts_N, num_experts)  # sentinel sorts last
    if policy == "probs":
        order_N = torch.argsort(-priority_TK.t().reshape(-1).float(), stable=True)
    else:
        order_N = torch.arange(T * K, device=indices_TK.device)
    by_expert = torch.argsort(experts_N[order_N], stable=True)
    order_N = order_N[by_expert]
    sorted_experts_N = experts_N[order_N]
    counts_E1 = count_ids(sorted_experts_N, num_experts + 1)
    starts_E1 = torch.cumsum(counts_E1, 0) - counts_E1
    rank_N = torch.arange(T * K, device=indices_TK.device) - starts_E1[sorted_experts_N]
    keep_sorted_N = (rank_N < capacity) & (sorted_experts_N < num_experts)
    kept_N = torch.zeros(T * K, dtype=torch.bool, device=indices_TK.device)
    kept_N[order_N] = keep_sorted_N
    return kept_N.view(K, T).t()
