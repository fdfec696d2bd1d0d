"""Activation recomputation per decoder layer (`train.recompute`), with torch's non-reentrant checkpoint.

Modes, per decoder layer (`DecoderLayer.recompute`): "none" keeps every activation; "moe" recomputes the
layer's FFN part (post-attention norm, MoE block or dense MLP, residual) in the backward pass, keeping its
input; "attention" recomputes the attention part (input norm, attention, residual); "full" recomputes the whole
layer, keeping only its input. A region is recomputed only while gradients are on (validation and frozen
layers run plain).

Exactness: the recomputation runs the same operations on the same inputs, with the random generators'
states of the forward restored (`preserve_rng_state`) and the router noise's key of the forward
(moebal/models/noise.py: router jitter and noise draw the same numbers) and rows' padding
(moebal/models/padding.py: the MoE losses leave out the same positions), so fp32
losses and gradients are bit-identical to "none". What must not happen twice is the MoE block's bookkeeping:
the replay of a recomputed region (the second call of the region's function) runs its MoE block inside
`MoELayer.replaying()`, which recomputes the routing, statistics and auxiliary loss (the backward needs their
saved tensors) without accumulating the step's routing statistics or replacing `aux_loss`, `last_stats`
and `last_routing`.

A MoE block whose forward talks to other ranks (expert parallelism's all-to-alls, routing statistics summed
over ranks: `MoELayer.is_local()` is false) is never replayed whole: a replay would rerun the collectives in
the backward pass (twice the all-to-all traffic, and Pro-Prophet's Trans and Agg hooks fired again). There
"moe" and "full" recompute the block's rank-local compute instead (`MoELayer.recompute_local`): the grouped
expert GEMMs on the rows this rank received, and the shared expert. The routing, the exchanged rows and the
returned expert outputs stay saved, which is what Megatron-style MoE recomputation keeps too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moebal.models import noise, padding

if TYPE_CHECKING:
    from moebal.models.moe import MoELayer

__all__ = ["RECOMPUTE_MODES", "recompute_call", "set_recompute"]

RECOMPUTE_MODES = ("none", "moe", "attention", "full")


def recompute_call(fn: Callable[..., torch.Tensor], moe: MoELayer | None, *args: Any,
                   replay: Callable[[], AbstractContextManager[Any]] | None = None) -> torch.Tensor:
    """fn(*args) whose activations are recomputed in the backward pass; the replay (fn's second call) runs
    inside `moe.replaying()` when the region holds a MoE block, and inside `replay()` when given (a dynamism
    scheme's own bookkeeping that must not happen twice: dynamic sparse attention's coverage statistics)."""
    calls = 0
    key = noise.current_key()  # the replay draws router noise under its forward's key, not the one set then
    rows = padding.current()  # and leaves out its forward's padding (moebal/models/padding.py)

    def run(*a: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        with ExitStack() as stack:
            if calls > 1:
                stack.enter_context(noise.keyed(key))
                stack.enter_context(padding.restored(rows))
                if moe is not None:
                    stack.enter_context(moe.replaying())
                if replay is not None:
                    stack.enter_context(replay())
            return fn(*a)

    out: torch.Tensor = checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
    return out


def set_recompute(root: nn.Module, mode: str) -> None:
    """Set the recomputation mode of every decoder layer under `root` (a model, a pipeline stage, a layer)."""
    from moebal.models.moe import MoELayer
    from moebal.models.transformer import DecoderLayer

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {', '.join(RECOMPUTE_MODES)}; got {mode!r}")
    for m in root.modules():
        if isinstance(m, DecoderLayer):
            m.recompute = mode
        elif isinstance(m, MoELayer):
            m.recompute_local = mode in ("moe", "full")
