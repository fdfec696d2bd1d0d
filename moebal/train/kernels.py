"""The run's expert kernel: settled once at start-up, the same on every rank, recorded, kept on resume.

The two expert back ends (`loop`, `grouped_mm`, moebal/kernels/expert_ffn.py) add the same products in orders
that are not bitwise equal on every device, so a run must not switch between them: not between ranks, not
between steps (a choice per row count would follow the routing), not across a restart. At start-up the run
takes, in this order,
  1. `moe.kernel` when it names a back end (the user's explicit choice);
  2. the kernel recorded in the checkpoint it resumes from, so a resumed or restarted run continues with the
     kernel it ran (even after an upgrade that changed `auto`'s rule), unless that kernel cannot run here;
  3. `auto`'s rule for the device, the layer shape and the compute dtype (`auto_kernel`: a rule, no timing,
     so two fresh runs of a seed choose alike);
then takes rank 0's choice on every rank (one all-gather), sets it on every MoE layer, and records it in
the run directory (`kernels.json`) and in every checkpoint (`state.json`, key "kernels").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moebal.config import Config
from moebal.kernels.expert_ffn import KERNELS, auto_kernel, grouped_mm_runs, grouped_mm_supports
from moebal.train.precision import uses_bf16

if TYPE_CHECKING:
    from moebal.models.moe import MoELayer

__all__ = ["settle_expert_kernel"]


def _runs_here(kernel: str, device: torch.device, dim: int, ffn: int, dtype: torch.dtype) -> bool:
    if kernel == "grouped_mm":
        return grouped_mm_supports(dim, ffn, dtype) and grouped_mm_runs(str(device), dtype)
    return kernel in KERNELS


def settle_expert_kernel(model: nn.Module, cfg: Config, device: torch.device,
                         gather: Callable[[Any], list[Any]] | None = None,
                         recorded: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Choose the run's expert kernel (module docstring), set it on every MoE layer of `model` and return the
    record to keep (None for a model without MoE layers). `gather` collects a value from every rank (rank
    order); `recorded` is the resumed checkpoint's record."""
    moe_layers = getattr(model, "moe_layers", None)  # a whole model or a pipeline stage; a plain module has none
    layers: list[MoELayer] = list(moe_layers()) if moe_layers is not None else []
    if not layers:
        return None
    w1 = layers[0].experts.w1
    _, ffn, dim = w1.shape
    dtype = torch.bfloat16 if uses_bf16(cfg, device) else w1.dtype
    old = (recorded or {}).get("kernel")
    if cfg.moe.kernel != "auto":
        mine = {"kernel": cfg.moe.kernel, "source": "config"}
    elif old is not None and _runs_here(old, device, dim, ffn, dtype):
        mine = {"kernel": old, "source": "checkpoint"}
    else:
        if old is not None:
            sys.stderr.write(f"moebal: the checkpoint's expert kernel {old!r} cannot run here ({device.type}, "
                             f"{dtype}): using auto's choice, so the losses may differ in the last bits from the "
                             f"run's before the checkpoint\n")
        mine = {"kernel": auto_kernel(device, dim, ffn, dtype), "source": "auto"}
    choice = (gather(mine) if gather is not None else [mine])[0]  # rank 0's, on every rank
    for layer in layers:
        layer.experts.kernel = choice["kernel"]
    return {**choice, "device": device.type, "dtype": str(dtype).removeprefix("torch."), "dim": dim, "ffn": ffn}
