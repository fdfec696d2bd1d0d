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
summed gradient (no model here does that). So is one more, for a weight tied to a tensor that is not a Linear's
(`model.tie_embeddings` on a one-stage pipeline, where the head is the embedding): the embedding's part enters
`.grad` in B and the head's in W, so with two or more micro-batches the additions run in another order (the
embedding's gradient within 1e-7 relative of autograd's; across stages the head holds a copy and nothing
changes). The engine tests compare the losses of "zb" and "1f1b" exactly.

Fully sharded stages (`parallel.shard: full`): FSDP2 swaps a Linear's weight for the all-gathered one for the
forward and the backward, and reduce-scatters in its post-backward hook only the gradients autograd produced;
by W(j) the module holds its dim-0 shard again. So a closure adds to the parameter the module holds *when W
runs*: a plain parameter as above, a shard (`GradReducer.holds`) through the queue's `reducer`, which keeps the
cost slot's whole weight gradients (cast to the dtype the forward used, as autograd's would be) and, as the
engine's W(j) finishes each slot (`flush`), reduce-scatters them into the shards' gradients as FSDP2 would have in
B(j) (moebal/distributed/fsdp.py `DeferredGradReducer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GradReducer", "WeightGradQueue"]


class GradReducer(Protocol):
    """Where the whole weight gradients of sharded parameters go during W (module docstring)."""

    def holds(self, p: torch.Tensor) -> bool:
        """Whether `p` (what the module holds at W) is a shard this reducer reduces into."""

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """Keep `g`, the whole gradient of the parameter whose shard is `p`, for the next `flush`."""

    def flush(self) -> None:
        """Reduce what `add` kept into the shards' gradients (collective over the shard's ranks)."""


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                sink: list[tuple[int, Callable[[], None]]], slot: int, queue: WeightGradQueue,
                module: nn.Linear) -> torch.Tensor:
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
        ctx.queue, ctx.module = queue, module
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
        queue, module = ctx.queue, ctx.module

        def weight_grad() -> None:
            with torch.no_grad():
                queue.accumulate(module, "weight", weight, g_NO.t().mm(x_NI))
                if bias is not None and bias.requires_grad:
                    queue.accumulate(module, "bias", bias, g_NO.sum(0))

        ctx.sink.append((ctx.slot, weight_grad))
        # the node may outlive this backward (a tensor's grad_fn): hold nothing
        ctx.sink = ctx.params = ctx.queue = ctx.module = None
        return gx, None, None, None, None, None, None


class WeightGradQueue:
    """Per micro-batch closures of deferred weight gradients, each tagged with the cost slot (layer) it
    belongs to; `installed` routes the stage's Linear layers through them for the duration of a run."""

    def __init__(self) -> None:
        self._items: dict[int, list[tuple[int, Callable[[], None]]]] = {}
        self._sink: list[tuple[int, Callable[[], None]]] | None = None
        self.slot = -1
        """The cost slot whose forward runs now (set by the engine as it walks the stage's layers)."""
        self.reducer: GradReducer | None = None
        """Where gradients of sharded parameters go (`parallel.shard: full`; module docstring); None: every
        gradient is added to the parameter the forward used, as autograd does."""

    def accumulate(self, module: nn.Module, name: str, used: torch.Tensor, g: torch.Tensor) -> None:
        """Add `g` to `module`'s parameter `name`: the one the forward used (`used`), or the shard the module
        holds now, through the reducer; cast to `used`'s dtype first, as autograd's gradient would be."""
        now = getattr(module, name)
        if self.reducer is not None and self.reducer.holds(now):
            self.reducer.add(now, g.to(used.dtype))
        else:
            _accumulate(used, g)

    def flush(self) -> None:
        """End of a slot's closures in a W op: the reducer's reductions (no-op without one)."""
        if self.reducer is not None:
            self.reducer.flush()

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
        out: torch.Tensor = _DeferredLinear.apply(x, w, module.bias, self._sink, self.slot, self, module)
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
