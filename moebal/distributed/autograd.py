"""Collectives inside autograd.

Shape legend: N = rows sent by this rank, M = rows received, D = row width.

Devices: every tensor here is per-step data on the compute device (NCCL on CUDA under the device-aware
backend, `moebal.distributed.groups.backend_for`), issued from the compute thread on its current stream: torch orders
NCCL's stream after it, and the blocking calls order the compute stream after NCCL's, so the results are
ready for the next kernel without a host wait. Split sizes are Python ints the caller already holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "exchange_counts", "sum_gradients"]


class _AllToAllRows(torch.autograd.Function):
    """Rows of x_ND go to ranks in blocks of `send_splits`; blocks of `recv_splits` rows arrive.

    The backward pass is the same exchange with the splits swapped: the gradient of a row travels back to the
    rank that sent it.
    """

    @staticmethod
    def forward(ctx: Any, x_ND: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out_MD = x_ND.new_empty((sum(recv_splits), *x_ND.shape[1:]))
        dist.all_to_all_single(out_MD, x_ND.contiguous(), recv_splits, send_splits, group=group)
        return out_MD

    @staticmethod
    def backward(ctx: Any, grad_MD: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_splits, recv_splits = ctx.splits
        grad_ND = grad_MD.new_empty((sum(send_splits), *grad_MD.shape[1:]))
        dist.all_to_all_single(grad_ND, grad_MD.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad_ND, None, None, None


def all_to_all_rows(x_ND: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group: Any) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0."""
    y_MD: torch.Tensor = _AllToAllRows.apply(x_ND, list(send_splits), list(recv_splits), group)  # apply: Any
    return y_MD


def exchange_counts(send_counts: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all of per-destination counts: entry j of the result is what rank j will send here.

    `send_counts` has shape [R, ...] (R = group size), int64 on the communication device.
    """
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


def sum_gradients(params: Sequence[torch.nn.Parameter], group: Any, divisor: float) -> None:
    """grad <- (sum over `group` of grad) / divisor, as one flat all-reduce (missing gradients count as zero)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()
