"""Per-layer routing statistics, kept as device tensors and read (one host sync) once per step.

Shape legend: E experts, K = top_k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebal.routing.balance import assignment_counts
from moebal.routing.gate import Routing
from moebal.sync import count_ids, to_host


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
        # Python numbers enter device tensors by fills only: `t[i] = T` on CUDA is a host-to-device copy (a sync)
        dev = routed_E.device
        if r.taken_TK is None:
            used_K = torch.cat([torch.zeros(K - 1, dtype=torch.int64, device=dev),
                                torch.full((1,), T, dtype=torch.int64, device=dev)])
        else:
            used_K = count_ids(r.taken_TK.sum(dim=-1) - 1, K)
        tokens = torch.full((), T, dtype=torch.int64, device=dev)
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

    def packed(self) -> torch.Tensor:
        """int64 [2E + K + 1]: counts, routed, used_k, tokens (what travels in one collective)."""
        return torch.cat([self.counts_E, self.routed_E, self.used_K, self.tokens.reshape(1)])

    @classmethod
    def unpack(cls, v: torch.Tensor, num_experts: int) -> RoutingStats:
        """The inverse of `packed` (views into v)."""
        E = num_experts
        return cls(counts_E=v[:E], routed_E=v[E:2 * E], used_K=v[2 * E:-1], tokens=v[-1])

    def read(self) -> dict[str, Any]:
        """Plain Python numbers (one host sync; `read_all` reads many layers with one)."""
        return read_all([self])[0]


def read_all(stats: list[RoutingStats]) -> list[dict[str, Any]]:
    """Every layer's statistics as plain Python numbers, with one host sync for all of them."""
    if not stats:
        return []
    sizes = [s.packed().numel() for s in stats]
    flat = to_host(torch.cat([s.packed() for s in stats]), "routing statistics")
    out, at = [], 0
    for s, n in zip(stats, sizes):
        out.append(packed_numbers(flat[at:at + n], s.counts_E.numel()))
        at += n
    return out


def packed_numbers(v: list[int], E: int) -> dict[str, Any]:
    """One layer's statistics as plain numbers from its `RoutingStats.packed` values (host ints, E experts)."""
    counts, routed, used, tokens = v[:E], v[E:2 * E], v[2 * E:-1], v[-1]
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
