"""MoE routing as a source of per-layer cost: the model is unchanged, routing moves the work between layers.

Shape legend: E = experts, L = layers.

Per MoE layer and step, from the layer's `RoutingStats` (counts per expert of kept assignments): the expert
work of a layer on one rank is proportional to its kept assignments (the grouped GEMM runs every routed row;
adaptive top-k and capacity drops lower it); under expert parallelism the layer waits for its busiest rank,
so the work is E x the largest expert count over E experts per rank. DynMo leaves this mapping open; this
settles it, with `ep_size` choosing which:

    factor_i = (non-FFN work + FFN work x rows_i / (tokens_i x top_k)) / (non-FFN + FFN work),
    rows_i = sum_E counts (one rank)  or  max_E counts x E (expert parallel, perfectly spread = sum).

Non-MoE layers have factor 1. Iteration k's routing predicts iteration k + 1 (the planner acts after the step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moebal.pipeline.dynamism import Dynamism, layer_token_flops, register

__all__ = ["MoERoutingCost", "routing_cost_factor"]


def routing_cost_factor(flops: dict[str, float], counts_E: list[float], tokens: float, top_k: int,
                        expert_parallel: bool = False) -> float:
    """Predicted cost of an MoE layer relative to a perfectly balanced, drop-free top-k routing."""
    if tokens <= 0:
        return 1.0
    rows = max(counts_E) * len(counts_E) if expert_parallel else sum(counts_E)
    other = flops["q_o"] + flops["kv"] + flops["attn"]
    return (other + flops["ffn"] * rows / (tokens * top_k)) / (other + flops["ffn"])


@register("moe")
class MoERoutingCost(Dynamism):
    name = "moe"

    def __init__(self, cfg: Any, ep_size: int = 1) -> None:
        self.cfg, self.L, self.E, self.K = cfg, cfg.model.n_layers, cfg.moe.num_experts, cfg.moe.top_k
        self.expert_parallel = ep_size > 1
        self.flops = [layer_token_flops(cfg, i, cfg.data.seq_len) for i in range(self.L)]
        self.counts = torch.zeros(self.L, max(self.E, 1) + 1, dtype=torch.float64)  # per layer: E counts, tokens
        self.factors = [1.0] * self.L

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.counts.zero_()

    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        out = layer(h_BTD, cos_TK, sin_TK)
        if layer.is_moe:
            s = layer.block_sparse_moe.last_stats
            self.counts[i, :self.E] += s.counts_E.double().cpu()
            self.counts[i, self.E] += float(s.tokens)
        return out

    def stats_size(self, num_layers: int) -> int:
        return self.counts.numel()

    def local_stats(self) -> torch.Tensor:
        return self.counts.reshape(-1).clone()

    def set_global_stats(self, vec: torch.Tensor) -> None:
        c = vec.reshape(self.counts.shape)
        self.factors = [routing_cost_factor(self.flops[i], c[i, :self.E].tolist(), float(c[i, self.E]), self.K,
                                            self.expert_parallel) if self.cfg.is_moe_layer(i) else 1.0
                        for i in range(self.L)]

    def cost_factors(self, num_layers: int) -> list[float]:
        return list(self.factors)

    def metrics(self) -> dict[str, Any]:
        return {"predicted_cost": [round(f, 4) for f in self.factors]}
