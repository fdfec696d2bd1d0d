"""The expert exchange of one MoE layer in c token chunks: Lina's all-to-all micro-ops, pipelined with experts.

Shape legend: N rows this rank sends (sorted by destination rank, then expert), M rows it receives (sorted by
source rank, then expert), D row width, R ranks in the expert-parallel group, E logical experts,
L experts computed on this rank.

Forward (`expert_exchange`), with c chunks:
  1. issue the c dispatch all-to-alls at once (async). Chunk i carries part i of every destination's block
     of rows (each block split into c near-equal parts along its rows, i.e. along tokens), so a receiver
     knows each chunk's per-(source, expert) counts from the count exchange alone;
  2. for i = 0..c-1: wait for dispatch i        <- compute thread blocks (exposed if chunk i is late)
                     regroup chunk i by expert, run the experts on it (while chunks i+1.. are in transit),
                     issue combine all-to-all i (async);
  3. wait for every combine                      <- compute thread blocks
     and put the returned rows back in send order.
Backward mirrors it: the c output-gradient all-to-alls are issued at once, then per chunk: wait, expert
backward on that chunk, issue the input-gradient all-to-all; finally wait for all of them.

The expert computation of each chunk is recorded as its own small autograd graph during the forward (on
detached inputs and weights) and differentiated chunk by chunk in the backward, so the backward can be
pipelined like the forward; the weight gradients are the sum of the chunks' (a chunked sum: with c > 1 it can
differ from the one-chunk gradient in the last bits, with c = 1 it is the same computation as the plain path).

The thesis pipelines only the forward dispatch ("FFN starts right after each all-to-all micro-op"); we
pipeline both directions of both passes, which is the same idea applied to every all-to-all of the layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from moebal.kernels.dispatch import DispatchPlan
from moebal.sync import upload

if TYPE_CHECKING:
    from moebal.models.moe import SwiGLUExperts
    from moebal.scheduler.core import CommScheduler

__all__ = ["ExchangePlan", "expert_exchange", "group_plan", "regroup", "split_sizes"]


def split_sizes(n: int, c: int) -> list[int]:
    """n rows in c near-equal parts (the first n % c parts one row longer)."""
    return [n // c + (1 if i < n % c else 0) for i in range(c)]


def group_plan(counts: list[int], device: torch.device) -> DispatchPlan:
    """A plan that only carries per-expert row counts (rows are already grouped by expert); the counts are
    known on the host and uploaded without a sync."""
    counts_E = upload(counts, device, torch.int64)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    plan = DispatchPlan(order_N=empty, token_N=empty, counts_E=counts_E, num_tokens=0, top_k=1)
    plan._host = list(counts)
    return plan


def regroup(counts_RE: np.ndarray, local: list[int]) -> tuple[np.ndarray, list[int]]:
    """Row permutation from (source rank, expert) order to (expert, source rank) order, and rows per expert."""
    counts_RE = np.asarray(counts_RE, dtype=np.int64)
    sub_RL = counts_RE[:, local] if local else np.zeros((counts_RE.shape[0], 0), dtype=np.int64)
    if counts_RE[:, [e for e in range(counts_RE.shape[1]) if e not in local]].any():
        raise RuntimeError("received tokens for an expert this rank does not hold: ranks disagree on the placement")
    starts_RL = (np.cumsum(sub_RL.reshape(-1)) - sub_RL.reshape(-1)).reshape(sub_RL.shape)
    pieces = [np.arange(starts_RL[s, j], starts_RL[s, j] + sub_RL[s, j])
              for j in range(sub_RL.shape[1]) for s in range(sub_RL.shape[0])]
    perm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return perm, sub_RL.sum(axis=0).tolist()


def _range_counts(counts_E: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per-expert rows inside positions [lo, hi) of a block sorted by expert with `counts_E` rows each."""
    cum = np.cumsum(counts_E)
    start = cum - counts_E
    rows_E: np.ndarray = np.clip(np.minimum(cum, hi) - np.maximum(start, lo), 0, None)
    return rows_E


@dataclass
class _Chunk:
    send: list[int]  # rows to each destination
    recv: list[int]  # rows from each source
    send_idx: torch.Tensor | None  # positions in x_ND (None: all rows, c = 1)
    perm: torch.Tensor  # received order -> (expert, source) order
    plan: DispatchPlan  # rows per local expert


@dataclass
class ExchangePlan:
    """Host-side layout of one exchange: who sends what to whom, chunk by chunk."""

    send_counts: list[list[int]]
    """[R][E] rows this rank sends to each rank, per expert."""
    recv_counts: list[list[int]]
    """[R][E] rows each rank sends to this one, per expert."""
    local: list[int]
    """Experts computed on this rank (ascending)."""
    chunks: int
    device: torch.device
    layer: int = -1
    parts: list[_Chunk] = field(default_factory=list)
    on_weight_grads: Callable[[list[torch.Tensor | None]], None] | None = None
    """Called in the backward with the [w1, w3, w2] gradients of the local experts as soon as they exist
    (Pro-Prophet's block overlap issues Agg from here)."""
    recompute: bool = False
    """Keep only each chunk's received rows and recompute the expert activations in the backward pass
    (`train.recompute`: moebal/models/recompute.py)."""

    def __post_init__(self) -> None:
        # The chunk count is the planner's, the same on every rank of the group: each chunk is one all-to-all that
        # every rank issues, so no rank may fall back to fewer on its own (a rank with few rows sends empty
        # chunks; one that issued fewer collectives than its peers would pair them wrongly and hang).
        c = max(1, int(self.chunks))
        send_R = [sum(r) for r in self.send_counts]
        recv_R = [sum(r) for r in self.recv_counts]
        self.chunks = c
        send_parts = [split_sizes(n, c) for n in send_R]
        recv_parts = [split_sizes(n, c) for n in recv_R]
        starts = np.cumsum([0, *send_R])[:-1]
        rc = np.asarray(self.recv_counts, dtype=np.int64).reshape(len(recv_R), -1)
        for i in range(c):
            send = [p[i] for p in send_parts]
            recv = [p[i] for p in recv_parts]
            idx = None
            if c > 1:
                lo = [int(starts[j]) + sum(send_parts[j][:i]) for j in range(len(send_R))]
                idx = upload(np.concatenate([np.arange(a, a + n) for a, n in zip(lo, send)])
                             if send else np.zeros(0, np.int64), self.device, torch.int64)
            counts_RE = np.stack([_range_counts(rc[s], sum(recv_parts[s][:i]), sum(recv_parts[s][:i + 1]))
                                  for s in range(len(recv_R))]) if recv_R else rc
            perm, per_expert = regroup(counts_RE, self.local)
            self.parts.append(_Chunk(send, recv, idx, upload(perm, self.device, torch.int64),
                                     group_plan(per_expert, self.device)))

    @property
    def send_rows(self) -> int:
        return sum(sum(r) for r in self.send_counts)


def expert_exchange(x_ND: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    plan: ExchangePlan, experts: SwiGLUExperts, sched: CommScheduler, group: Any) -> torch.Tensor:
    """Dispatch x_ND, run `experts.compute` on the received rows with `weights`, return the outputs in x_ND's
    row order (see the module docstring); differentiable in x_ND and the weights."""
    grad = torch.is_grad_enabled() and (x_ND.requires_grad or any(w.requires_grad for w in weights))
    y_ND: torch.Tensor = _Exchange.apply(x_ND, *weights, plan, experts, sched, group, grad)  # apply is typed Any
    return y_ND


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_ND: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                plan: ExchangePlan, experts: SwiGLUExperts, sched: CommScheduler, group: Any,
                grad: bool) -> torch.Tensor:
        tag = f"L{plan.layer}"
        D = x_ND.shape[1]
        # 1. every dispatch chunk at once
        recvs, handles = [], []
        for i, ch in enumerate(plan.parts):
            send = x_ND if ch.send_idx is None else x_ND.index_select(0, ch.send_idx)
            recv = x_ND.new_empty((sum(ch.recv), D))
            handles.append(sched.all_to_all(recv, send, ch.recv, ch.send, group, name=f"{tag} dispatch{i}",
                                            layer=plan.layer, chunk=i))
            recvs.append(recv)
        # 2. per chunk: wait, experts, combine
        wq = [w.detach().requires_grad_(w.requires_grad) for w in (w1, w3, w2)] if grad else [w1, w3, w2]
        graphs, outs, combines = [], [], []
        for i, ch in enumerate(plan.parts):
            handles[i].wait()
            t = time.perf_counter()
            x_in = recvs[i].index_select(0, ch.perm)
            if grad:
                x_in.requires_grad_(True)
                with torch.enable_grad():
                    if plan.recompute:  # the expert backward (below) recomputes them from x_in
                        y = checkpoint(experts.compute, x_in, wq[0], wq[1], wq[2], ch.plan, use_reentrant=False)
                    else:
                        y = experts.compute(x_in, wq[0], wq[1], wq[2], ch.plan)
                graphs.append((x_in, y))
            else:
                y = experts.compute(x_in, wq[0], wq[1], wq[2], ch.plan)
            back = torch.empty_like(y).index_copy(0, ch.perm, y.detach()) if ch.perm.numel() else y.detach()
            sched.log.span("compute", f"{tag} experts{i}", t)
            out = back.new_empty((sum(ch.send), back.shape[1]))
            combines.append(sched.all_to_all(out, back, ch.send, ch.recv, group, name=f"{tag} combine{i}",
                                             layer=plan.layer, chunk=i))
            outs.append(out)
        # 3. every combine, back in send order
        for h in combines:
            h.wait()
        if len(outs) == 1:
            y_ND = outs[0]
        else:
            y_ND = outs[0].new_empty((plan.send_rows, outs[0].shape[1]))
            for ch, out in zip(plan.parts, outs):
                assert ch.send_idx is not None  # set for every chunk when there are several
                y_ND.index_copy_(0, ch.send_idx, out)
        ctx.plan, ctx.sched, ctx.group, ctx.graphs, ctx.wq = plan, sched, group, graphs, wq
        ctx.x_dtype = x_ND.dtype
        return y_ND

    @staticmethod
    def backward(ctx: Any, g_ND: torch.Tensor) -> tuple[Any, ...]:
        plan, sched, group = ctx.plan, ctx.sched, ctx.group
        tag = f"L{plan.layer}"
        g_ND = g_ND.contiguous()
        # 1. every output-gradient chunk at once (the reverse of the combine)
        recvs, handles = [], []
        for i, ch in enumerate(plan.parts):
            send = g_ND if ch.send_idx is None else g_ND.index_select(0, ch.send_idx)
            recv = g_ND.new_empty((sum(ch.recv), g_ND.shape[1]))
            handles.append(sched.all_to_all(recv, send, ch.recv, ch.send, group, name=f"{tag} combine{i} bwd",
                                            layer=plan.layer, chunk=i))
            recvs.append(recv)
        # 2. per chunk: wait, expert backward, issue the input-gradient chunk
        wants = [w for w in ctx.wq if w.requires_grad]
        dW: list[torch.Tensor | None] = [None] * len(wants)
        outs, sends = [], []
        for i, ch in enumerate(plan.parts):
            handles[i].wait()
            t = time.perf_counter()
            x_in, y = ctx.graphs[i]
            gy = recvs[i].index_select(0, ch.perm).to(y.dtype)
            grads = torch.autograd.grad(y, [x_in, *wants], gy, allow_unused=True)
            gx = grads[0] if grads[0] is not None else torch.zeros_like(x_in)
            for j, g in enumerate(grads[1:]):
                prev = dW[j]
                if g is not None:  # the chunks' sum in fp32 (bf16 stacked replicas), cast once below
                    dW[j] = g.float() if prev is None else prev + g.float()
            gx_recv = torch.empty_like(gx).index_copy(0, ch.perm, gx) if ch.perm.numel() else gx
            sched.log.span("compute", f"{tag} experts{i} bwd", t)
            out = gx_recv.new_empty((sum(ch.send), gx_recv.shape[1]))
            sends.append(sched.all_to_all(out, gx_recv, ch.send, ch.recv, group, name=f"{tag} dispatch{i} bwd",
                                          layer=plan.layer, chunk=i))
            outs.append(out)
        ctx.graphs = []
        it = iter(dW)
        w_grads = [next(it) if w.requires_grad else None for w in ctx.wq]
        w_grads = [g if g is None else g.to(w.dtype) for g, w in zip(w_grads, ctx.wq)]
        for j, w in enumerate(ctx.wq):
            if w.requires_grad and w_grads[j] is None:
                w_grads[j] = torch.zeros_like(w)
        if plan.on_weight_grads is not None:
            plan.on_weight_grads(w_grads)
        for h in sends:
            h.wait()
        if len(outs) == 1:
            gx_ND = outs[0]
        else:
            gx_ND = outs[0].new_empty((plan.send_rows, outs[0].shape[1]))
            for ch, out in zip(plan.parts, outs):
                gx_ND.index_copy_(0, ch.send_idx, out)
        return (gx_ND.to(ctx.x_dtype), *w_grads, None, None, None, None, None)
