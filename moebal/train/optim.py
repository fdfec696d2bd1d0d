"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moebal.config import TrainConfig

__all__ = ["build_optimizer", "lr_at", "param_groups", "schedule_change"]


def param_groups(model: nn.Module, weight_decay: float, skip: Sequence[torch.Tensor] = ()) -> list[dict[str, Any]]:
    """Weight decay only on parameters with two or more dimensions (linear, embedding and stacked expert
    matrices); norms, biases and any 1-D parameter (a router bias, say) are not decayed, since shrinking them
    towards zero has no regularising meaning (RMSNorm gains should sit near one). `skip`: parameters another
    rank steps (a pipeline's tied head copy, moebal/pipeline/tied.py)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    skipped = {id(p) for p in skip}
    for p in model.parameters():
        if p.requires_grad and id(p) not in skipped:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, t: TrainConfig, skip: Sequence[torch.Tensor] = ()) -> torch.optim.AdamW:
    """AdamW; the fused kernel where torch has one (CPU and CUDA float parameters): on this 2-core CPU it
    steps a 13M-parameter model in ~9 ms against ~350 ms for the multi-tensor (foreach) version. `skip`: as
    `param_groups`'."""
    groups = param_groups(model, t.weight_decay, skip)
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                             fused=fused or None, foreach=None if fused else True)


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up from lr / warmup to lr, then
    `t.schedule`: cosine or linear decay to lr * min_lr_ratio at the last step; wsd: lr until the last
    `decay_fraction` of the steps after the warm-up (at least one), which descend linearly to the floor, the
    last step at it; constant: lr."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    floor = t.lr * t.min_lr_ratio
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        decay = max(1, round(t.decay_fraction * (t.steps - t.warmup_steps)))
        start = t.steps - decay  # the first step below lr
        return t.lr if step < start else t.lr + (floor - t.lr) * min((step - start + 1) / decay, 1.0)
    span = t.steps - t.warmup_steps - 1  # the decay's steps after its first; none: its one step is the last
    progress = 1.0 if span <= 0 else min(max(step - t.warmup_steps, 0) / span, 1.0)
    if t.schedule == "linear":
        return t.lr + (floor - t.lr) * progress
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULE_KEYS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "schedule", "decay_fraction")
"""The settings `lr_at` reads: `train.steps` is the schedule's horizon as well as the run's length."""


def schedule_change(was: TrainConfig, now: TrainConfig, step: int) -> str | None:
    """A line when a resume after `step` optimizer steps under schedule `now` does not continue the curve the
    checkpoint's run (`was`) trained on: the two disagree at the last step done. Extending a cosine or linear
    run moves its decay under the steps already taken, and a wsd run extended after its decay began jumps back
    up to lr; a constant schedule, or a wsd one extended in its stable phase (tests/unit/test_train.py), goes on
    as it was and says nothing."""
    changed = [f"train.{k} {getattr(was, k)} -> {getattr(now, k)}" for k in SCHEDULE_KEYS
               if getattr(was, k) != getattr(now, k)]
    if not changed or step < 1 or lr_at(step - 1, was) == lr_at(step - 1, now):
        return None
    return (f"the learning-rate schedule differs from the checkpoint's run ({', '.join(changed)}): step {step} "
            f"trained at lr {lr_at(step - 1, was):.3g}, where this schedule has {lr_at(step - 1, now):.3g}, and "
            f"step {step + 1} runs at {lr_at(step, now):.3g}")
