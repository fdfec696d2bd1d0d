"""`moe_layer` with Tutel's constructor and forward signature (tutel/impls/moe_layer.py), its top gate
(`gates[i].wg`, `top_k`) and its llama_ffn expert's parameter layout (W_fc1, W_fc2 [L, D, F] and W_fc3
[L, F, D], flattened), computed plainly and locally: each rank runs the tokens routed to the L experts it
holds (global ids rank * L ...), tokens routed elsewhere add nothing (no all-to-all). Tests only.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, L local experts, K top_k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class TopGate(nn.Module):
    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 gate_noise: float = 0.0, fp32_gate: bool = False) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False)
        self.top_k, self.capacity_factor, self.gate_noise = min(k, num_global_experts), capacity_factor, gate_noise

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.wg(x_TD)


class LlamaFFN(nn.Module):
    def __init__(self, model_dim: int, hidden_size_per_expert: int, local_experts: int,
                 activation_fn: Any = torch.nn.functional.silu) -> None:
        super().__init__()
        L, D, F = local_experts, model_dim, hidden_size_per_expert
        self.shapes = {"W_fc1": (L, D, F), "W_fc2": (L, D, F), "W_fc3": (L, F, D)}
        for name, shape in self.shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(L * shape[1] * shape[2]) * 0.01))
        self.activation_fn = activation_fn

    def expert(self, i: int, x_ND: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (getattr(self, n).view(self.shapes[n])[i] for n in ("W_fc1", "W_fc2", "W_fc3"))
        return (self.activation_fn(x_ND @ w1) * (x_ND @ w2)) @ w3


class moe_layer(nn.Module):  # noqa: N801 - Tutel's public name
    def __init__(self, gate_type: dict, model_dim: int, experts: dict | None = None, scan_expert_func: Any = None,
                 result_func: Any = None, group: Any = None, seeds: Any = None, a2a_ffn_overlap_degree: int = 1,
                 is_postscore: bool = True, batch_prioritized_routing: bool = False, normalize_gate: bool = True,
                 is_gshard_loss: bool = True, parallel_type: str = "adaptive:1", use_2dh: bool = False,
                 **kwargs: Any) -> None:
        super().__init__()
        if kwargs:
            raise Exception(f"Unrecognized argument provided to Tutel Moe-layer: {next(iter(kwargs))}")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        experts = dict(experts or {})
        if experts.pop("type") != "llama_ffn":
            raise Exception("Builtin expert type is not recognized (the stand-in has llama_ffn only)")
        self.num_local_experts = experts.pop("count_per_node", 1)
        self.first_expert = rank * self.num_local_experts
        self.experts = LlamaFFN(model_dim, local_experts=self.num_local_experts, **experts)
        gate = {k: v for k, v in gate_type.items() if k != "type"}
        self.gates = nn.ModuleList([TopGate(model_dim, self.num_local_experts * world, **gate)])
        self.normalize_gate, self.model_dim = normalize_gate, model_dim

    def forward(self, input: torch.Tensor, gate_index: int = 0, **_: Any) -> torch.Tensor:
        x_TD = input.reshape(-1, self.model_dim)
        gate = self.gates[gate_index]
        w_TK, idx_TK = torch.softmax(gate(x_TD).float(), dim=-1).topk(gate.top_k, dim=-1)
        if self.normalize_gate:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
        y_TD = torch.zeros_like(x_TD)
        for i in range(self.num_local_experts):
            t, j = torch.where(idx_TK == self.first_expert + i)
            y_TD = y_TD.index_add(0, t, self.experts.expert(i, x_TD[t]) * w_TK[t, j, None].to(x_TD.dtype))
        return y_TD.view(input.shape)
