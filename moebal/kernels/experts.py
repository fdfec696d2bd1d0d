"""Grouped SwiGLU experts over dispatched rows: y = w2(silu(w1 x) * w3 x) per expert (HF Mixtral maths).

One autograd Function runs the whole expert MLP so backward does only the work it needs: it saves the two
projections, the silu output and the product (as autograd would for a dense SwiGLU), reuses buffers in
place, and writes each expert's weight gradient straight into one stacked tensor.

Two back ends compute the per-expert matmuls on rows grouped by expert:
- `loop`: one `torch.mm(out=...)` per expert piece. On CPU the rows are split into contiguous ranges, one
  per intra-op thread, each run by a single-threaded worker (forward, then backward by rows, then weight
  gradients by output slices): three barriers per forward + backward instead of one per small GEMM.
  Needs the per-expert counts on the host.
- `grouped_mm`: `torch.nn.functional.grouped_mm` with int32 cumulative offsets (no host sync).
`choose_kernel` picks one by measurement, once per (rows bucket, shape, dtype, device), and caches it.

Shape legend: N dispatched rows grouped by expert, E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from moebal.kernels.dispatch import DispatchPlan
from moebal.kernels.workers import cpu_workers, run_parallel

KernelName = Literal["loop", "grouped_mm"]
KERNELS: tuple[KernelName, ...] = ("loop", "grouped_mm")


# ---- `loop`: rows split into contiguous ranges, one single-threaded CPU worker per range -------------------

def _segments(counts: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(expert, start, stop) pieces of the row range [lo, hi) (rows are grouped by expert)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        s, t = max(start, lo), min(start + n, hi)
        if s < t:
            out.append((e, s, t))
        start += n
        if start >= hi:
            break
    return out


def _ranges(total: int, parts: int) -> list[tuple[int, int]]:
    bounds = [total * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _loop_forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, plan: DispatchPlan
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    N, F_, D = x.shape[0], w1.shape[1], w2.shape[1]
    counts = plan.host_counts()
    h1, h3, s1, a = (x.new_empty((N, F_)) for _ in range(4))
    y = x.new_empty((N, D))

    def rows(lo: int, hi: int) -> None:
        segs = _segments(counts, lo, hi)
        for e, s, t in segs:
            torch.mm(x[s:t], w1[e].t(), out=h1[s:t])
            torch.mm(x[s:t], w3[e].t(), out=h3[s:t])
        torch.ops.aten.silu.out(h1[lo:hi], out=s1[lo:hi])
        torch.mul(s1[lo:hi], h3[lo:hi], out=a[lo:hi])
        for e, s, t in segs:
            torch.mm(a[s:t], w2[e].t(), out=y[s:t])

    run_parallel([functools.partial(rows, lo, hi) for lo, hi in _ranges(N, cpu_workers(N, x.device))])
    return y, (h1, h3, s1, a)


def _loop_backward(g: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   saved: tuple[torch.Tensor, ...], plan: DispatchPlan, need: tuple[bool, ...]
                   ) -> tuple[torch.Tensor | None, ...]:
    h1, h3, s1, a = saved
    N = x.shape[0]
    counts = plan.host_counts()
    da, dh3 = g.new_empty(h1.shape), g.new_empty(h1.shape)
    dx = g.new_empty(x.shape) if need[0] else None

    def rows(lo: int, hi: int) -> None:  # phase 1, by rows: d(product), silu backward, input gradient
        segs = _segments(counts, lo, hi)
        for e, s, t in segs:
            torch.mm(g[s:t], w2[e], out=da[s:t])
        torch.mul(da[lo:hi], s1[lo:hi], out=dh3[lo:hi])
        da[lo:hi].mul_(h3[lo:hi])
        torch.ops.aten.silu_backward.grad_input(da[lo:hi], h1[lo:hi], grad_input=da[lo:hi])  # da is now dh1
        if dx is not None:
            for e, s, t in segs:
                torch.mm(da[s:t], w1[e], out=dx[s:t])
                dx[s:t].addmm_(dh3[s:t], w3[e])

    workers = cpu_workers(N, x.device)
    run_parallel([functools.partial(rows, lo, hi) for lo, hi in _ranges(N, workers)])
    dh1 = da
    grads = [g.new_empty(w.shape) if n else None for w, n in zip((w1, w3, w2), need[1:4])]
    # phase 2, weight gradients: worker p computes the p-th slice of output rows of every expert's
    # gradient (each reduces over all of that expert's rows), so the work splits evenly however skewed.
    pairs = [(grads[0], dh1, x), (grads[1], dh3, x), (grads[2], g, a)]

    def weights(p: int) -> None:
        for dw, dout, inp in pairs:
            if dw is None:
                continue
            lo, hi = _ranges(dw.shape[1], workers)[p]
            start = 0
            for e, n in enumerate(counts):
                if n:
                    torch.mm(dout[start:start + n, lo:hi].t(), inp[start:start + n], out=dw[e, lo:hi])
                else:
                    dw[e, lo:hi].zero_()
                start += n

    run_parallel([functools.partial(weights, p) for p in range(workers)])
    return dx, grads[0], grads[1], grads[2]


# ---- `grouped_mm`: one grouped GEMM per projection (no host sync, accelerators) -------------------------

def _gmm(x_NI: torch.Tensor, w_EOI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    return F.grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=plan.offsets())


def _gmm_wgrad(g_NO: torch.Tensor, x_NI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    return F.grouped_mm(g_NO.t(), x_NI, offs=plan.offsets())


def _gmm_forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, plan: DispatchPlan
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    h1, h3 = _gmm(x, w1, plan), _gmm(x, w3, plan)
    s1 = F.silu(h1)
    a = s1 * h3
    return _gmm(a, w2, plan), (h1, h3, s1, a)


def _gmm_backward(g: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  saved: tuple[torch.Tensor, ...], plan: DispatchPlan, need: tuple[bool, ...]
                  ) -> tuple[torch.Tensor | None, ...]:
    h1, h3, s1, a = saved
    dw2 = _gmm_wgrad(g, a, plan) if need[3] else None
    da = _gmm(g, w2.transpose(1, 2), plan)  # g @ w2[e]
    dh3 = da * s1
    dh1 = torch.ops.aten.silu_backward(da.mul_(h3), h1)
    dw1 = _gmm_wgrad(dh1, x, plan) if need[1] else None
    dw3 = _gmm_wgrad(dh3, x, plan) if need[2] else None
    dx = None
    if need[0]:
        dx = _gmm(dh1, w1.transpose(1, 2), plan)
        dx.add_(_gmm(dh3, w3.transpose(1, 2), plan))
    return dx, dw1, dw3, dw2


_IMPLS = {"loop": (_loop_forward, _loop_backward), "grouped_mm": (_gmm_forward, _gmm_backward)}


class _SwiGLUExperts(torch.autograd.Function):
    """Saves what a dense SwiGLU's autograd saves (x, both projections, silu output, product); backward
    allocates only the product gradient, one projection gradient, dx and the stacked weight gradients."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,  # type: ignore[override]
                w2_EDF: torch.Tensor, plan: DispatchPlan, kernel: str) -> torch.Tensor:
        y_ND, saved = _IMPLS[kernel][0](x_ND, w1_EFD, w3_EFD, w2_EDF, plan)
        ctx.save_for_backward(x_ND, w1_EFD, w3_EFD, w2_EDF, *saved)
        ctx.plan, ctx.kernel = plan, kernel
        return y_ND

    @staticmethod
    def backward(ctx, g_ND: torch.Tensor):  # type: ignore[override]
        x_ND, w1_EFD, w3_EFD, w2_EDF, *saved = ctx.saved_tensors
        grads = _IMPLS[ctx.kernel][1](g_ND.contiguous(), x_ND, w1_EFD, w3_EFD, w2_EDF, tuple(saved), ctx.plan,
                                      tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None)


def swiglu_experts(x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                   plan: DispatchPlan, kernel: KernelName) -> torch.Tensor:
    """y_ND = w2[e](silu(w1[e] x) * w3[e] x) for each row's expert e (rows grouped as in `plan`)."""
    if x_ND.shape[0] == 0:
        kernel = "loop"  # grouped_mm rejects an empty operand; the loop yields empty rows and zero gradients
    return _SwiGLUExperts.apply(x_ND, w1_EFD, w3_EFD, w2_EDF, plan, kernel)


def reference_experts(x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                      plan: DispatchPlan) -> torch.Tensor:
    """Plain autograd per-expert loop: the parity reference for the fused kernels."""
    outs, start = [], 0
    for e, n in enumerate(plan.host_counts()):
        xe = x_ND[start:start + n]
        outs.append(F.linear(F.silu(F.linear(xe, w1_EFD[e])) * F.linear(xe, w3_EFD[e]), w2_EDF[e]))
        start += n
    return torch.cat(outs) if outs else x_ND.new_zeros((0, w2_EDF.shape[1]))


def grouped_mm_supports(dim: int, ffn: int, dtype: torch.dtype) -> bool:
    """`grouped_mm` needs row strides that are multiples of 16 bytes in every operand."""
    size = torch.empty((), dtype=dtype).element_size()
    return (dim * size) % 16 == 0 and (ffn * size) % 16 == 0


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=64)
def _measured_choice(rows: int, dim: int, ffn: int, experts: int, dtype: torch.dtype, device: str) -> KernelName:
    """Fastest back end for a balanced forward + backward at this shape (a memo of measurements)."""
    from moebal.kernels.bench import time_interleaved
    from moebal.kernels.dispatch import make_plan

    gen = torch.Generator(device="cpu").manual_seed(0)
    idx_T1 = torch.randint(0, experts, (rows, 1), generator=gen).to(device)
    plan = make_plan(idx_T1, None, experts)
    x = torch.randn(rows, dim, generator=gen).to(device, dtype).requires_grad_()
    ws = [(torch.randn(experts, a, b, generator=gen) * 0.02).to(device, dtype).requires_grad_()
          for a, b in ((ffn, dim), (ffn, dim), (dim, ffn))]

    def run(kernel: KernelName) -> Callable[[], None]:
        def step() -> None:
            with torch.enable_grad():
                swiglu_experts(x, ws[0], ws[1], ws[2], plan, kernel).sum().backward()
        return step

    candidates: dict[str, Callable[[], None]] = {}
    for kernel in KERNELS:
        if kernel == "grouped_mm" and not grouped_mm_supports(dim, ffn, dtype):
            continue
        try:
            run(kernel)()
        except (RuntimeError, NotImplementedError):
            if kernel == "loop":
                raise
            continue  # e.g. grouped_mm without a kernel for this dtype/device
        candidates[kernel] = run(kernel)
    if len(candidates) == 1:
        return next(iter(candidates))  # type: ignore[return-value]
    timings = time_interleaved(candidates, warmup=1, repeats=3, device=device)
    # The minimum, not the median: on a shared machine interference only ever adds time.
    return min(timings, key=lambda k: timings[k].min)  # type: ignore[return-value]


SMALL_WORK = 1 << 22
"""Below this many multiply-adds per expert GEMM (rows * dim * ffn) timing is noise: take the default."""


def choose_kernel(rows: int, dim: int, ffn: int, experts: int, dtype: torch.dtype,
                  device: torch.device) -> KernelName:
    """The measured-faster back end, cached per (rows rounded up to a power of two, shape, dtype, device).

    Tiny problems skip the measurement: `grouped_mm` on accelerators (no host sync) when its alignment
    allows, the loop on CPU.
    """
    if rows * dim * ffn < SMALL_WORK:
        if device.type != "cpu" and grouped_mm_supports(dim, ffn, dtype):
            return "grouped_mm"
        return "loop"
    dev = str(device) if device.type != "cpu" else "cpu"
    return _measured_choice(_bucket(max(rows, 1)), dim, ffn, experts, dtype, dev)
