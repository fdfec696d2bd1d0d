"""Sort-based token permutation: the dispatch plan, dispatch (gather) and weighted combine.

A dispatched row n is one active (token, choice) assignment; rows are grouped by expert (expert 0's rows
first), and within an expert kept in token order (a stable sort), so results do not depend on the sort.

Shape legend: T tokens, K = top_k, E experts, N dispatched rows (= T * K when nothing is dropped), D model dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from moebal.kernels.workers import cpu_workers, run_parallel
from moebal.sync import count_ids, to_host


@dataclass
class DispatchPlan:
    """Where each dispatched row comes from and how many rows each expert gets.

    A plan made without a host sync (`make_plan(..., trim=False)` with an active mask) keeps a row for every
    assignment: the inactive ones sort after every expert's rows (beyond the last offset), `valid_N` marks the
    real rows, and the caller zeroes the rest (`mask_tail`)."""

    order_N: torch.Tensor
    """int64 flat assignment index (t * K + j) of each row, grouped by expert."""
    token_N: torch.Tensor
    """int64 source token of each row."""
    counts_E: torch.Tensor
    """int64 rows per expert (on the tokens' device)."""
    num_tokens: int
    top_k: int
    valid_N: torch.Tensor | None = None
    """bool: rows that belong to an expert (None: all of them)."""
    _host: list[int] | None = field(default=None, repr=False)
    _offsets: torch.Tensor | None = field(default=None, repr=False)
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.order_N.shape[0])

    def host_counts(self) -> list[int]:
        """Rows per expert as Python ints (a host sync on accelerators; cached)."""
        if self._host is None:
            self._host = to_host(self.counts_E, "expert row counts")
        return self._host

    @property
    def all_active(self) -> bool:
        """Every (token, choice) assignment is dispatched (dropless fixed top-k): N = T * K."""
        return self.valid_N is None and self.num_rows == self.num_tokens * self.top_k

    def mask_tail(self, rows_ND: torch.Tensor) -> torch.Tensor:
        """rows_ND with the rows beyond the experts' (inactive assignments) set to zero, exactly, whatever they
        held (a kernel leaves them unwritten); differentiable: their gradient is dropped the same way."""
        if self.valid_N is None:
            return rows_ND
        return rows_ND.masked_fill(~self.valid_N.unsqueeze(1), 0)

    def slots(self) -> torch.Tensor:
        """int64 slot_TK: the dispatched row of each assignment (only when every assignment is active)."""
        assert self.all_active, "slots exist only when every assignment is dispatched"
        if self._slots is None:
            slots_A = torch.empty_like(self.order_N)
            slots_A[self.order_N] = torch.arange(self.order_N.shape[0], device=self.order_N.device)
            self._slots = slots_A.view(self.num_tokens, self.top_k)
        return self._slots

    def offsets(self) -> torch.Tensor:
        """int32 inclusive cumulative counts: `grouped_mm`'s `offs` (no host sync)."""
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts_E, 0).to(torch.int32)
        return self._offsets


def make_plan(indices_TK: torch.Tensor, active_TK: torch.Tensor | None, num_experts: int, *,
              trim: bool = True) -> DispatchPlan:
    """Plan for the active assignments: one stable argsort of expert ids, counts by a scatter-add.

    With an active mask, `trim` reads the per-expert counts on the host once (the one sync of a kernel that
    needs host counts anyway) and keeps only the active rows; `trim=False` keeps every row and marks the
    active ones (`valid_N`): no host sync, for kernels that take their offsets on the device."""
    T, K = indices_TK.shape
    experts_A = indices_TK.reshape(-1)
    if active_TK is not None:
        experts_A = torch.where(active_TK.reshape(-1), experts_A, num_experts)  # inactive sort last
    order_A = torch.sort(experts_A, stable=True).indices
    counts_E1 = count_ids(experts_A, num_experts + 1)
    counts_E = counts_E1[:num_experts]
    valid_N, host = None, None
    if active_TK is not None and trim:
        host = to_host(counts_E1, "expert row counts")
        order_A = order_A[: T * K - host[num_experts]]
        host = host[:num_experts]
    elif active_TK is not None:
        valid_N = torch.arange(T * K, device=experts_A.device) < T * K - counts_E1[num_experts]
    token_N = torch.div(order_A, K, rounding_mode="floor")
    return DispatchPlan(order_N=order_A, token_N=token_N, counts_E=counts_E, num_tokens=T, top_k=K, valid_N=valid_N,
                        _host=host)


def _row_ranges(total: int, device: torch.device) -> list[tuple[int, int]]:
    parts = cpu_workers(total, device, min_rows=256)
    bounds = [total * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src[index], split by output rows over the CPU workers (one barrier)."""
    out = src.new_empty((index.shape[0], src.shape[1]))

    def part(lo: int, hi: int) -> None:
        torch.index_select(src, 0, index[lo:hi], out=out[lo:hi])

    run_parallel([functools.partial(part, lo, hi) for lo, hi in _row_ranges(index.shape[0], src.device)])
    return out


def _sum_slots(rows_ND: torch.Tensor, plan: DispatchPlan, w_TK: torch.Tensor | None) -> torch.Tensor:
    """out_TD[t] = sum_j (w_TK[t, j] *) rows_ND[slot_TK[t, j]]: a gather per choice, split by tokens, in place
    of a scatter-add (every assignment active). Products are rounded before the sum, as in HF Mixtral."""
    slot_TK = plan.slots()
    out = rows_ND.new_empty((plan.num_tokens, rows_ND.shape[1]))

    def part(lo: int, hi: int) -> None:
        torch.index_select(rows_ND, 0, slot_TK[lo:hi, 0], out=out[lo:hi])
        if w_TK is not None:
            out[lo:hi].mul_(w_TK[lo:hi, 0:1])
        for j in range(1, plan.top_k):
            more = rows_ND.index_select(0, slot_TK[lo:hi, j])
            if w_TK is not None:
                more.mul_(w_TK[lo:hi, j:j + 1])
            out[lo:hi].add_(more)

    run_parallel([functools.partial(part, lo, hi) for lo, hi in _row_ranges(plan.num_tokens, rows_ND.device)])
    return out


class _Dispatch(torch.autograd.Function):
    """x_ND = x_TD[token_N]; backward sums each token's rows back (a gather per choice when every assignment
    is active, a scatter-add otherwise)."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        ctx.plan = plan
        return _gather_rows(x_TD, plan.token_N)

    @staticmethod
    @once_differentiable  # a second derivative is refused by name, not by an out= error inside
    def backward(ctx: Any, g_ND: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan: DispatchPlan = ctx.plan
        g_ND = g_ND.contiguous()
        if plan.all_active:
            return _sum_slots(g_ND, plan, None), None
        g_TD = g_ND.new_zeros((plan.num_tokens, g_ND.shape[1]))
        return g_TD.index_add_(0, plan.token_N, g_ND), None


class _Combine(torch.autograd.Function):
    """out_TD = sum over a token's rows of w * y_ND; backward gives dy = w * dout and dw = <dout, y>."""

    @staticmethod
    def forward(ctx: Any, y_ND: torch.Tensor, weights_TK: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        w_TK = weights_TK.to(y_ND.dtype)  # Mixtral multiplies in the hidden dtype
        w_N1 = w_TK.reshape(-1).index_select(0, plan.order_N).unsqueeze(1)
        ctx.save_for_backward(y_ND, w_N1)
        ctx.plan, ctx.w_dtype = plan, weights_TK.dtype
        if plan.all_active:
            return _sum_slots(y_ND, plan, w_TK)
        out_TD = y_ND.new_zeros((plan.num_tokens, y_ND.shape[1]))
        return out_TD.index_add_(0, plan.token_N, y_ND * w_N1)

    @staticmethod
    @once_differentiable  # a second derivative is refused by name, not by an out= error inside
    def backward(ctx: Any, g_TD: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        y_ND, w_N1 = ctx.saved_tensors
        plan: DispatchPlan = ctx.plan
        need_y, need_w = ctx.needs_input_grad[:2]
        g_ND = _gather_rows(g_TD.contiguous(), plan.token_N)
        g_w_N = g_ND.new_empty(g_ND.shape[0]) if need_w else None

        def part(lo: int, hi: int) -> None:
            if g_w_N is not None:  # in the hidden dtype, as autograd would
                torch.linalg.vecdot(g_ND[lo:hi], y_ND[lo:hi], out=g_w_N[lo:hi])
            if need_y:
                g_ND[lo:hi].mul_(w_N1[lo:hi])

        run_parallel([functools.partial(part, lo, hi) for lo, hi in _row_ranges(g_ND.shape[0], g_ND.device)])
        g_w = None
        if g_w_N is not None:
            g_w = torch.zeros(plan.num_tokens * plan.top_k, dtype=ctx.w_dtype, device=g_ND.device)
            g_w[plan.order_N] = g_w_N.to(ctx.w_dtype)
            g_w = g_w.view(plan.num_tokens, plan.top_k)
        return (g_ND if need_y else None), g_w, None


def dispatch(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Rows x_ND for the experts, grouped by expert (differentiable)."""
    x_ND: torch.Tensor = _Dispatch.apply(x_TD, plan)  # Function.apply is typed Any
    return x_ND


def combine(y_ND: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor) -> torch.Tensor:
    """out_TD: each token's expert outputs weighted by its gate weights (differentiable in both)."""
    out_TD: torch.Tensor = _Combine.apply(y_ND, weights_TK, plan)  # Function.apply is typed Any
    return out_TD
