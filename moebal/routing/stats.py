"""Per-layer routing statistics, kept as device tensors and read (one host sync) once per step.

Shape legend: E experts, K = top_k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebal.routing.balance import assignment_counts
from moebal.routing.gate import Routing


@dataclass
class RoutingStats:
    """What one MoE layer did over one or more forwards (add micro-batches with `add`)."""

    counts_E: torch.Tensor
    """int64 assignments each expert computed (kept after capacity drops)."""
    routed_E: torch.Tensor
    """int64 assignments the gate chose for each expert, before capacity drops."""
    used_K: torch.Tensor
    """int64 tokens whose gate took j + 1 experts, j = 0..K-1 (adaptive gating spreads these)."""
    tokens: torch.Tensor
    """int64 scalar: tokens routed."""

    @classmethod
    def zeros(cls, num_experts: int, top_k: int, device: torch.device | str | None = None) -> RoutingStats:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(counts_E=z(num_experts), routed_E=z(num_experts), used_K=z(top_k), tokens=z())

    @classmethod
    def from_routing(cls, r: Routing) -> RoutingStats:
        """Statistics of one routing decision (no host sync)."""
        T, K = r.indices_TK.shape
        E = r.probs_TE.shape[-1]
        routed_E = assignment_counts(r.indices_TK, r.taken_TK, E)
        counts_E = routed_E if r.active_TK is None else assignment_counts(r.indices_TK, r.active_TK, E)
        if r.taken_TK is None:
            used_K = torch.zeros(K, dtype=torch.int64, device=routed_E.device)
            used_K[K - 1] = T
        else:
            used_K = torch.bincount(r.taken_TK.sum(dim=-1) - 1, minlength=K)
        tokens = torch.tensor(T, dtype=torch.int64, device=routed_E.device)
        return cls(counts_E=counts_E, routed_E=routed_E, used_K=used_K, tokens=tokens)

    def add(self, other: RoutingStats) -> RoutingStats:
        """Accumulate another micro-batch in place; returns self."""
        self.counts_E += other.counts_E
        self.routed_E += other.routed_E
        self.used_K += other.used_K
        self.tokens += other.tokens
        return self

    def clone(self) -> RoutingStats:
        return RoutingStats(counts_E=self.counts_E.clone(), routed_E=self.routed_E.clone(),
                            used_K=self.used_K.clone(), tokens=self.tokens.clone())

    @property
    def dropped(self) -> torch.Tensor:
        """Assignments dropped by capacity (int64 scalar)."""
        return self.routed_E.sum() - self.counts_E.sum()

    @property
    def max_load(self) -> torch.Tensor:
        return self.counts_E.max()

    @property
    def mean_load(self) -> torch.Tensor:
        return self.counts_E.float().mean()

    @property
    def imbalance(self) -> torch.Tensor:
        """max / mean of the kept load (1 is perfect balance); 0 when nothing was routed."""
        mean = self.mean_load
        return torch.where(mean > 0, self.max_load.float() / mean.clamp(min=1e-12), torch.zeros_like(mean))

    def read(self) -> dict[str, Any]:
        """Plain Python numbers (the one host sync; call once per step)."""
        tokens = int(self.tokens.item())
        used = self.used_K.tolist()
        routed = self.routed_E.tolist()
        counts = self.counts_E.tolist()
        mean = sum(counts) / max(len(counts), 1)
        return {
            "tokens": tokens,
            "counts": counts,
            "routed": routed,
            "dropped": sum(routed) - sum(counts),
            "used_k": used,
            "used_k_share": [u / tokens if tokens else 0.0 for u in used],
            "max_load": max(counts) if counts else 0,
            "mean_load": mean,
            "imbalance": max(counts) / mean if mean > 0 else 0.0,
        }
