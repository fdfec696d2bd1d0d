"""Sort-based token permutation: the dispatch plan, dispatch (gather) and weighted combine.

A dispatched row n is one active (token, choice) assignment; rows are grouped by expert (expert 0's rows
first), and within an expert kept in token order (a stable sort), so results do not depend on the sort.

Shape legend: T tokens, K = top_k, E experts, N dispatched rows (= T * K when nothing is dropped), D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DispatchPlan:
    """Where each dispatched row comes from and how many rows each expert gets."""

    order_N: torch.Tensor
    """int64 flat assignment index (t * K + j) of each row, grouped by expert."""
    token_N: torch.Tensor
    """int64 source token of each row."""
    counts_E: torch.Tensor
    """int64 rows per expert (on the tokens' device)."""
    num_tokens: int
    top_k: int
    _host: list[int] | None = field(default=None, repr=False)
    _offsets: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.order_N.shape[0])

    def host_counts(self) -> list[int]:
        """Rows per expert as Python ints (a host sync on accelerators; cached)."""
        if self._host is None:
            self._host = self.counts_E.tolist()
        return self._host

    def offsets(self) -> torch.Tensor:
        """int32 inclusive cumulative counts: `grouped_mm`'s `offs` (no host sync)."""
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts_E, 0).to(torch.int32)
        return self._offsets


def make_plan(indices_TK: torch.Tensor, active_TK: torch.Tensor | None, num_experts: int) -> DispatchPlan:
    """Plan for the active assignments: one stable argsort of expert ids, counts by bincount."""
    T, K = indices_TK.shape
    experts_A = indices_TK.reshape(-1)
    if active_TK is not None:
        experts_A = torch.where(active_TK.reshape(-1), experts_A, num_experts)  # inactive sort last
    order_A = torch.sort(experts_A, stable=True).indices
    counts_E1 = torch.bincount(experts_A, minlength=num_experts + 1)
    counts_E = counts_E1[:num_experts]
    if active_TK is not None:
        order_A = order_A[: T * K - int(counts_E1[num_experts])]  # host sync: the row count
    token_N = torch.div(order_A, K, rounding_mode="floor")
    return DispatchPlan(order_N=order_A, token_N=token_N, counts_E=counts_E, num_tokens=T, top_k=K)


class _Dispatch(torch.autograd.Function):
    """x_ND = x_TD[token_N]; backward scatter-adds the rows back to their tokens."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, token_N: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(token_N)
        ctx.num_tokens = x_TD.shape[0]
        return x_TD.index_select(0, token_N)

    @staticmethod
    def backward(ctx, g_ND: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (token_N,) = ctx.saved_tensors
        g_TD = g_ND.new_zeros((ctx.num_tokens, g_ND.shape[1]))
        return g_TD.index_add_(0, token_N, g_ND), None


class _Combine(torch.autograd.Function):
    """out_TD = sum over a token's rows of w_N * y_ND; backward gives dy = w * dout and dw = <dout, y>."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, w_N: torch.Tensor, token_N: torch.Tensor,  # type: ignore[override]
                num_tokens: int) -> torch.Tensor:
        w_N1 = w_N.to(y_ND.dtype).unsqueeze(1)  # Mixtral multiplies in the hidden dtype
        ctx.save_for_backward(y_ND, w_N1, token_N)
        ctx.w_dtype = w_N.dtype
        out_TD = y_ND.new_zeros((num_tokens, y_ND.shape[1]))
        return out_TD.index_add_(0, token_N, y_ND * w_N1)

    @staticmethod
    def backward(ctx, g_TD: torch.Tensor):  # type: ignore[override]
        y_ND, w_N1, token_N = ctx.saved_tensors
        g_ND = g_TD.index_select(0, token_N)
        g_w = None
        if ctx.needs_input_grad[1]:
            g_w = torch.linalg.vecdot(g_ND, y_ND).to(ctx.w_dtype)  # in the hidden dtype, as autograd would
        g_y = g_ND.mul_(w_N1) if ctx.needs_input_grad[0] else None
        return g_y, g_w, None, None


def dispatch(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Rows x_ND for the experts, grouped by expert (differentiable)."""
    return _Dispatch.apply(x_TD, plan.token_N)


def combine(y_ND: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor) -> torch.Tensor:
    """out_TD: each token's expert outputs weighted by its gate weights (differentiable in both)."""
    w_N = weights_TK.reshape(-1).index_select(0, plan.order_N)
    return _Combine.apply(y_ND, w_N, plan.token_N, plan.num_tokens)
