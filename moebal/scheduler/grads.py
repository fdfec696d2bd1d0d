"""Data-parallel gradient all-reduce in fixed-size chunks, fed by backward hooks, issued by the scheduler.

Layout, fixed at start-up (identical on every rank, since every rank holds the same parameter shapes):
- one flat buffer per (communicator, dtype) holding its parameters' gradients, parameters in reverse
  registration order (roughly the order the backward pass finishes them);
- each buffer is cut into chunks of `chunk_bytes`; a chunk is ready when every gradient overlapping it is;
- one global issue order over all chunks: chunks fed by backward hooks first, those holding expert weights
  (released only after Agg, at the end of the backward pass) last; within each, by the position of the
  chunk's last gradient in that reverse order, then by buffer. Every rank issues chunks in this order (never
  in hook order), so the ranks agree. (Ordering the expert chunks by position alone put them first, since
  the experts are registered after their block's attention: every dense chunk then waited behind them for
  the end of the backward pass, and with data-parallel experts no gradient went out during the backward.)

Lina cuts each gradient on its own and never mixes two gradients in one micro-op, to keep the concatenation
simple. We cut a flat buffer instead: a large gradient still becomes equal-sized chunks, while the many small
ones (norms, routers, biases) share a chunk rather than each paying a collective's latency (about 0.1 ms on
gloo, more than the transfer itself); reassembly is a view into the buffer either way.

When a gradient is complete (a post-accumulate-grad hook for ordinary parameters; the expert-parallel
executor's explicit `mark_ready` for expert weights, whose gradients are final only after Agg) it is copied
into its buffer slot and the chunks it completes become ready. At `finish()` gradients that never arrived
count as zero (as the unscheduled sync does), the scheduler drains, the buffers are divided by the rank count
and every parameter's `.grad` becomes a view of its slot.

Numerics: the sum over ranks is the same sum as one all-reduce of the whole buffer; with more than two ranks
the communication library may add the ranks' values in an order that depends on where an element falls inside
its message, so chunking can change the last bit of a sum of three or more terms (within 1e-6 relative).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moebal.scheduler.core import BackgroundOp, CommScheduler

__all__ = ["GradSync", "GradGroup"]


@dataclass
class GradGroup:
    """Parameters whose gradients are summed over one communicator and divided by `divisor`."""

    name: str
    params: list[torch.nn.Parameter]
    group: Any
    divisor: float


@dataclass
class _Slot:
    buf: int
    start: int
    numel: int
    chunks: list[int]  # indices into the issue order


def _released_late(p: torch.nn.Parameter) -> bool:
    """Expert weights: their gradients are final only after Agg, so no hook releases them (see `finish`)."""
    return bool(getattr(p, "_moebal_expert_param", False))


class GradSync:
    """Chunked, scheduled gradient all-reduce of several parameter groups (see the module docstring)."""

    def __init__(self, sched: CommScheduler, groups: Sequence[GradGroup], chunk_bytes: float,
                 hooks: bool = True) -> None:
        self.sched = sched
        self.groups = [g for g in groups if g.params]
        order: dict[int, int] = {}
        for g in self.groups:
            for p in g.params:
                order.setdefault(id(p), len(order))
        position = {pid: len(order) - 1 - i for pid, i in order.items()}  # reverse registration order
        self.bufs: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._buf_meta: list[tuple[GradGroup, torch.dtype]] = []
        self.slots: dict[int, _Slot] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        chunks: list[tuple[int, int, int, int, int, list[int]]] = []  # (late, position, buf, start, stop, ids)
        for g in self.groups:
            for dtype in dict.fromkeys(p.dtype for p in g.params):
                ps = sorted((p for p in g.params if p.dtype == dtype), key=lambda p: position[id(p)])
                b = len(self.bufs)
                total = sum(p.numel() for p in ps)
                self.bufs.append(torch.empty(0, dtype=dtype, device=ps[0].device))  # allocated by begin_step
                self._sizes.append(total)
                self._buf_meta.append((g, dtype))
                offset, spans = 0, []
                for p in ps:
                    self.slots[id(p)] = _Slot(b, offset, p.numel(), [])
                    self.params[id(p)] = p
                    spans.append((offset, offset + p.numel(), id(p)))
                    offset += p.numel()
                itemsize = torch.empty((), dtype=dtype).element_size()
                elems = max(1, int(chunk_bytes // itemsize)) if chunk_bytes > 0 else max(total, 1)
                if g.group is None:
                    continue  # one rank: nothing to reduce, `finish` only divides
                for start in range(0, total, elems):
                    stop = min(total, start + elems)
                    pids = [pid for a, z, pid in spans if a < stop and z > start]
                    late = any(_released_late(self.params[pid]) for pid in pids)
                    chunks.append((int(late), max(position[pid] for pid in pids), b, start, stop, pids))
        chunks.sort(key=lambda c: (c[0], c[1], c[2], c[3]))
        self.chunks = [(b, start, stop) for _, _, b, start, stop, _ in chunks]
        self._chunk_params = [pids for *_, pids in chunks]
        for k, pids in enumerate(self._chunk_params):
            for pid in pids:
                self.slots[pid].chunks.append(k)
        self._missing = [0] * len(self.chunks)
        self._arrived: set[int] = set()
        self._active = False
        self._handles = []
        if hooks and sched.mode != "off":
            self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params.values()
                             if not _released_late(p)]

    @property
    def active(self) -> bool:
        """Between `begin_step` and `finish`."""
        return self._active

    @property
    def reduced_bytes(self) -> int:
        """Bytes all-reduced per step (buffers of one-rank groups excluded)."""
        return sum(n * self.bufs[b].element_size() for b, n in enumerate(self._sizes)
                   if self._buf_meta[b][0].group is not None)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def _op(self, k: int) -> BackgroundOp:
        b, start, stop = self.chunks[k]
        g, dtype = self._buf_meta[b]
        view = self.bufs[b][start:stop]
        nbytes = view.numel() * view.element_size()

        def launch() -> Any:
            if g.group is None:
                return None
            return dist.all_reduce(view, group=g.group, async_op=True)

        return BackgroundOp("allreduce", f"{g.name} allreduce {k}", nbytes, launch, group=g.name, chunk=k)

    def begin_step(self) -> None:
        """Arm the hooks for one backward pass."""
        for b, n in enumerate(self._sizes):
            if self.bufs[b].numel() != n:  # first step: gradient-sized buffers only once they are used
                self.bufs[b] = torch.zeros(n, dtype=self.bufs[b].dtype, device=self.bufs[b].device)
        self._missing = [len(p) for p in self._chunk_params]
        self._arrived = set()
        self._active = True
        self.sched.begin_step([self._op(k) for k in range(len(self.chunks))])

    def _hook(self, p: torch.Tensor) -> None:
        if self._active:
            self.mark_ready(p)

    def mark_ready(self, p: torch.Tensor) -> None:
        """`p.grad` is final for this step: copy it into its slot and release the chunks it completes."""
        pid = id(p)
        if not self._active or pid in self._arrived or pid not in self.slots:
            return
        self._arrived.add(pid)
        s = self.slots[pid]
        dst = self.bufs[s.buf][s.start:s.start + s.numel]
        if p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.detach().reshape(-1))
        for k in s.chunks:  # empty for a one-rank group
            self._missing[k] -= 1
            if self._missing[k] == 0:
                self.sched.ready(k)

    def finish(self) -> None:
        """After backward (and Agg): missing gradients count as zero; wait for every chunk; set the averages."""
        if not self._active:
            return
        for p in self.params.values():
            self.mark_ready(p)
        try:
            self.sched.drain()
        finally:
            self._active = False
        for b, buf in enumerate(self.bufs):
            buf.div_(self._buf_meta[b][0].divisor)
        for pid, s in self.slots.items():
            p = self.params[pid]
            p.grad = self.bufs[s.buf][s.start:s.start + s.numel].view_as(p)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
