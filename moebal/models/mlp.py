"""The dense SwiGLU MLP (HF names gate_proj/up_proj/down_proj): a dense layer's FFN and the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), bias-free."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # Module.__call__ is Any
        return y
