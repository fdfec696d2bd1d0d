"""Compute precision: which of fp32 and bf16 autocast a run uses on its device.

`train.precision: auto` (the default) takes bf16 autocast (fp32 master weights) where the device computes
bf16 natively and fp32 elsewhere:

- CUDA: bf16 where the GPU supports it (Ampere and later), else fp32;
- CPU: bf16 where oneDNN has a native bf16 path (AVX-512 cores, with or without the BF16 extension, and AMX),
  else fp32. Measured on an AVX2-only core (torch 2.13, 1 thread): a 256 x 128 x 384 matmul takes 0.29 ms in
  fp32 and 8.3 ms in bf16 (a scalar fallback, 29x slower), so bf16 there would slow a run by an order of
  magnitude while saving nothing.

An explicit `bf16` or `fp32` is kept as given. The train command resolves `auto` once, before any rank
starts, and writes the resolved value to the run's config.yaml, so a resumed run computes in the precision it
started with even on another machine (its losses stay bit for bit those of the uninterrupted run).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["autocast_dtype", "bf16_native", "compute_precision", "resolve_precision", "uses_bf16"]


def bf16_native(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively (see the module docstring)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without oneDNN: judge by the vector unit
            return "AVX512" in torch.backends.cpu.get_cpu_capability()
    return False


def compute_precision(precision: str, device: torch.device) -> str:
    """"bf16" or "fp32": `precision` ("auto", "bf16" or "fp32") on `device`."""
    if precision == "auto":
        return "bf16" if bf16_native(device) else "fp32"
    return precision


def uses_bf16(cfg: Any, device: torch.device) -> bool:
    """Whether a run of `cfg` on `device` computes under bf16 autocast."""
    return compute_precision(cfg.train.precision, device) == "bf16"


def autocast_dtype(cfg: Any, device: torch.device) -> torch.dtype | None:
    """The dtype a run of `cfg` on `device` autocasts to (None: fp32, no autocast): what its timings use."""
    return torch.bfloat16 if uses_bf16(cfg, device) else None


def resolve_precision(cfg: Any, device: torch.device) -> Any:
    """`cfg` with `train.precision: auto` replaced by what it means on `device` (other values unchanged)."""
    if cfg.train.precision != "auto":
        return cfg
    train = dataclasses.replace(cfg.train, precision=compute_precision("auto", device))
    return dataclasses.replace(cfg, train=train)
