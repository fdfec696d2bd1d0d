"""MoE routing as a source of per-layer cost: the model is unchanged, routing moves the work between layers.

Shape legend: E = experts, L = layers.

Per MoE layer and step, from the layer's `RoutingStats` (counts per expert of kept assignments): the expert
work of a layer on one rank is proportional to its kept assignments (the grouped GEMM runs every routed row;
adaptive top-k and capacity drops lower it); under expert parallelism over R ranks (E/R experts each, in
contiguous blocks as `default_owners` shards them) the layer waits for its busiest rank. DynMo leaves this
mapping open; this settles it:

    factor_i = (non-FFN work + FFN work x rows_i / (tokens_i x top_k)) / (non-FFN + FFN work),
    rows_i = sum_E counts (R = 1)  or  R x max_r sum_{e of rank r} counts (perfectly spread = sum).

R is the job's expert-parallel size when it has one (pipeline x expert parallelism), else `ep_size` (to
model an expert-parallel deployment from a run without one). Counts are summed over every rank of a stage
and along the pipeline, so every rank predicts the same. Non-MoE layers have factor 1. Iteration k's
routing predicts iteration k + 1 (the planner acts after the step, and the runner rescales each layer's
measured cost by this prediction between profiles: `runner.py`).

Under a replicating placement policy (Pro-Prophet's replicas of hot experts, `planner.policy` other than
static) the busiest rank computes fewer rows than its owned experts' (the contiguous-owner formula above is then
an upper bound): the runner hands the scheme each MoE layer's imbalance under the placement the step ran
(`observe_placement`: the busiest rank's computed rows over the mean, the largest over the data-parallel
replicas), and the layer's rows are that imbalance times the step's assignments,

    rows_i = imbalance_i x sum_E counts.

The step's own placement (planned from the step before) predicts the next one's, as its counts do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moebal.dynamism.scheme import Dynamism, SchemeContext, as_decoder, layer_token_flops, register
from moebal.errors import ConfigError
from moebal.sync import to_host

__all__ = ["MoERoutingCost", "routing_cost_factor"]


def routing_cost_factor(flops: dict[str, float], counts_E: list[float], tokens: float, top_k: int,
                        ranks: int = 1, imbalance: float | None = None) -> float:
    """Predicted cost of an MoE layer relative to a perfectly balanced, drop-free top-k routing, with its
    experts spread over `ranks` ranks in contiguous blocks, or with its busiest rank computing `imbalance` times
    the mean rank's rows (a measured placement's)."""
    if tokens <= 0:
        return 1.0
    if imbalance is not None:
        rows = imbalance * sum(counts_E)
    elif ranks > 1:
        per = len(counts_E) // ranks
        rows = ranks * max(sum(counts_E[r * per:(r + 1) * per]) for r in range(ranks))
    else:
        rows = sum(counts_E)
    other = flops["q_o"] + flops["kv"] + flops["attn"]
    return (other + flops["ffn"] * rows / (tokens * top_k)) / (other + flops["ffn"])


@register("moe")
class MoERoutingCost(Dynamism):
    name = "moe"
    replan_every_step = True
    uses_placement = True

    def __init__(self, cfg: Any, ep_size: int = 1) -> None:
        self.cfg, self.L, self.E, self.K = cfg, cfg.model.n_layers, cfg.moe.num_experts, cfg.moe.top_k
        if ep_size < 1 or (ep_size > 1 and self.E % ep_size):
            raise ConfigError(f"dynamism moe: ep_size ({ep_size}) must be >= 1 and divide moe.num_experts ({self.E})")
        self.ranks = ep_size
        self.flops = [layer_token_flops(cfg, i, cfg.data.seq_len) for i in range(self.L)]
        self.counts = torch.zeros(self.L, max(self.E, 1) + 1, dtype=torch.float64)  # per layer: E counts, tokens
        self._device_counts: torch.Tensor | None = None
        """The step's counts as the forwards add them, on the compute device: read to the host once per step
        (`local_stats`), not once per layer and micro-batch inside the schedule."""
        self.factors = [1.0] * self.L
        self._global: torch.Tensor | None = None
        """The step's chain-summed counts (`set_global_stats`), which `observe_placement` prices again."""

    def on_start(self, ctx: SchemeContext) -> None:
        if ctx.ep > 1:
            self.ranks = ctx.ep  # the job's own expert parallelism

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.counts.zero_()
        self._device_counts = None

    def layer_forward(self, i: int, layer: nn.Module, h_BTD: torch.Tensor, cos_TK: torch.Tensor,
                      sin_TK: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = layer(h_BTD, cos_TK, sin_TK)
        block = as_decoder(layer)
        if block.is_moe:
            s = block.block_sparse_moe.last_stats
            assert s is not None  # set by the forward just run
            if self._device_counts is None:
                self._device_counts = torch.zeros(self.counts.shape, dtype=torch.float64, device=s.counts_E.device)
            self._device_counts[i, :self.E] += s.counts_E.double()
            self._device_counts[i, self.E] += s.tokens.double()
        return out

    def stats_size(self, num_layers: int) -> int:
        return self.counts.numel()

    def local_stats(self) -> torch.Tensor:
        if self._device_counts is not None:  # integers in float64: the same sums in any order
            self.counts = torch.tensor(to_host(self._device_counts, "moe scheme: expert counts"), dtype=torch.float64)
            self._device_counts = None
        return self.counts.reshape(-1).clone()

    def set_global_stats(self, vec: torch.Tensor) -> None:
        self._global = vec.reshape(self.counts.shape)
        self._price(None)

    def observe_placement(self, imbalance: list[float]) -> None:
        self._price(imbalance)

    def _price(self, imbalance: list[float] | None) -> None:
        """The factors of the step's counts: under contiguous owners, or under the measured imbalance of each
        MoE layer (where it has one: a layer no stage reported keeps the owners' formula)."""
        c = self._global
        assert c is not None
        self.factors = [routing_cost_factor(self.flops[i], c[i, :self.E].tolist(), float(c[i, self.E]), self.K,
                                            self.ranks,
                                            imbalance[i] if imbalance is not None and imbalance[i] > 0 else None)
                        if self.cfg.is_moe_layer(i) else 1.0 for i in range(self.L)]

    def cost_factors(self, num_layers: int) -> list[float]:
        return list(self.factors)

    def metrics(self) -> dict[str, Any]:
        return {"predicted_cost": [round(f, 4) for f in self.factors]}
