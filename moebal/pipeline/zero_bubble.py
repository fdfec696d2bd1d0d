"""Deferred weight gradients for the zero-bubble schedule: B(j) now, W(j) later.

Shape legend: N = rows (tokens) of a Linear's input, I = input features, O = output features.

Under the "zb" schedule (`schedule.py`) a stage's B(j) computes what the previous stage waits for, and the
weight gradients of its Linear layers wait for W(j). While the engine runs the schedule, every plain
`nn.Linear` of the stage (exactly that class, with the class's own forward: a module whose forward was
replaced, such as a pruned layer on the CSR kernel, keeps it) runs through `_DeferredLinear`: its backward
returns the input gradient and leaves a closure that computes and accumulates the weight (and bias) gradient
in the queue of the micro-batch whose forward built it. Everything else (norms, embeddings, MoE expert
weights, routers outside nn.Linear) gets its gradient in B as before.

Bit-identical to autograd: the closures compute what autograd's matmul backward computes, with the same
operations on the same operands (input gradient grad @ W; weight gradient grad^T @ x, for a 2-D or
flattened input; bias gradient the sum over rows), in the autocast dtype when autocast is on, then cast to
the parameter's dtype and added to `.grad` in micro-batch order, as autograd's accumulation does. One
difference is possible: a Linear called twice in one micro-batch gets two additions instead of one of the
summed gradient (no model here does that). The engine tests compare the losses of "zb" and "1f1b" exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradQueue"]


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                sink: list[tuple[int, Callable[[], None]]], slot: int) -> torch.Tensor:
        dev = x.device.type
        xc, wc, bc = x, weight, bias
        if torch.is_autocast_enabled(dev):  # what autocast would do to F.linear's operands
            dt = torch.get_autocast_dtype(dev)
            xc, wc = x.to(dt), weight.to(dt)
            bc = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            out = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.params, ctx.x_dtype, ctx.sink, ctx.slot = (weight, bias), x.dtype, sink, slot
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xc, wc = ctx.saved_tensors
        g_NO = grad.reshape(-1, grad.shape[-1])
        gx = g_NO.mm(wc).view(*grad.shape[:-1], wc.shape[1]).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        # Detached: an input saved as is (fp32, or already in the autocast dtype) carries its grad_fn, and the
        # closure would keep the graph upstream of this layer alive, and with it every other deferred Linear's
        # node of the micro-batch (a reference cycle through C++ nodes, which Python's collector cannot break).
        x_NI = xc.detach().reshape(-1, xc.shape[-1])
        weight, bias = ctx.params

        def weight_grad() -> None:
            with torch.no_grad():
                _accumulate(weight, g_NO.t().mm(x_NI))
                if bias is not None and bias.requires_grad:
                    _accumulate(bias, g_NO.sum(0))

        ctx.sink.append((ctx.slot, weight_grad))
        ctx.sink = ctx.params = None  # the node may outlive this backward (a tensor's grad_fn): hold nothing
        return gx, None, None, None, None


class WeightGradQueue:
    """Per micro-batch closures of deferred weight gradients, each tagged with the cost slot (layer) it
    belongs to; `installed` routes the stage's Linear layers through them for the duration of a run."""

    def __init__(self) -> None:
        self._items: dict[int, list[tuple[int, Callable[[], None]]]] = {}
        self._sink: list[tuple[int, Callable[[], None]]] | None = None
        self.slot = -1
        """The cost slot whose forward runs now (set by the engine as it walks the stage's layers)."""

    @contextmanager
    def capture(self, j: int) -> Iterator[None]:
        """Linear layers called inside defer their weight gradients to micro-batch j's W."""
        self._sink = self._items.setdefault(j, [])
        try:
            yield
        finally:
            self._sink = None

    def pop(self, j: int) -> list[tuple[int, Callable[[], None]]]:
        """Micro-batch j's closures, in the order its backward left them; the queue keeps no reference."""
        items = self._items.pop(j, [])
        out = list(items)
        items.clear()  # graph nodes of the micro-batch may still point at this list
        return out

    def pending(self) -> int:
        return sum(len(v) for v in self._items.values())

    def clear(self) -> None:
        self._items.clear()

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if self._sink is None or not torch.is_grad_enabled() or not (w.requires_grad and w.is_leaf):
            return F.linear(x, w, module.bias)
        out: torch.Tensor = _DeferredLinear.apply(x, w, module.bias, self._sink, self.slot)
        return out

    @contextmanager
    def installed(self, root: nn.Module) -> Iterator[None]:
        """Route every plain nn.Linear under `root` through `linear` until the block ends."""
        mods = [m for m in root.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
        for m in mods:
            # an instance attribute shadows the class's forward; popped from __dict__ when the block ends
            m.forward = (lambda mod: lambda x: self.linear(mod, x))(m)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in mods:
                m.__dict__.pop("forward", None)
