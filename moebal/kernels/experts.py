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
`auto_kernel` is `kernel="auto"`'s rule (the loop on CPU, grouped_mm on accelerators); a training run settles
its one kernel at start-up and keeps it (moebal/train/kernels.py).

On this CPU (MKL, AVX-512) the two back ends give the same bits with one intra-op thread, fp32 and bf16, every
pass, and the loop gives the same bits at any thread count (its workers never cut a sliver off an expert,
see `_row_ranges`); multi-threaded `grouped_mm` does not in fp32 at some shapes, and on GPUs they differ.

Shape legend: N dispatched rows grouped by expert, E experts, D model dim, F expert hidden dim.
"""

from __future__ import annotations

import functools
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


MIN_PIECE = 16
"""Fewest rows of one expert a worker boundary may leave on either side of it (see `_row_ranges`)."""


def _ranges(total: int, parts: int) -> list[tuple[int, int]]:
    bounds = [total * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _row_ranges(counts: list[int], total: int, parts: int) -> list[tuple[int, int]]:
    """Near-equal contiguous row ranges, one per worker, whose boundaries never cut fewer than MIN_PIECE rows
    off an expert: a boundary that would is moved to that expert's edge.

    Why: a BLAS may compute a GEMM of a few rows on another path than a taller one (MKL here: 1 to 3 rows
    round differently), so a sliver of an expert would change the results with the number of workers and make
    `loop` differ from `grouped_mm` (which multiplies each expert's rows at once). Pieces of at least
    MIN_PIECE rows give each row the bits of the whole expert's GEMM.
    """
    bounds = [total * i // parts for i in range(parts + 1)]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    e = 0
    for i in range(1, parts):
        c = max(bounds[i], bounds[i - 1])
        while starts[e + 1] <= c and e + 1 < len(counts):
            e += 1
        # the piece this boundary closes starts at the expert's first row or at the previous boundary, whichever
        # is later; both it and the rest of the expert must keep MIN_PIECE rows, else snap to the nearer end
        s, t = max(starts[e], bounds[i - 1]), starts[e + 1]
        if s < c < t and (c - s < MIN_PIECE or t - c < MIN_PIECE):
            c = s if c - s <= t - c else t
        bounds[i] = c
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]


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

    ranges = _row_ranges(counts, N, cpu_workers(N, x.device))
    run_parallel([functools.partial(rows, lo, hi) for lo, hi in ranges])
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
            # dx = dh1 w1 + dh3 w3 as two rounded products and one add, like `grouped_mm` (and autograd): an
            # accumulating addmm_ rounds once, which differs in the last bit (in bf16 by up to 1e-3)
            tmp = dx.new_empty((hi - lo, dx.shape[1]))
            for e, s, t in segs:
                torch.mm(da[s:t], w1[e], out=dx[s:t])
                dx[s:t].add_(torch.mm(dh3[s:t], w3[e], out=tmp[s - lo:t - lo]))

    workers = cpu_workers(N, x.device)
    run_parallel([functools.partial(rows, lo, hi) for lo, hi in _row_ranges(counts, N, workers)])
    dh1 = da
    grads = [g.new_empty(w.shape) if n else None for w, n in zip((w1, w3, w2), need[1:4])]
    # phase 2, weight gradients: worker p computes the p-th slice of output rows of every expert's
    # gradient (each reduces over all of that expert's rows), so the work splits evenly however skewed.
    pairs = [(grads[0], dh1, x), (grads[1], dh3, x), (grads[2], g, a)]

    def weights(p: int) -> None:
        for dw, dout, inp in pairs:
            if dw is None:
                continue
            parts = max(1, min(workers, dw.shape[1] // MIN_PIECE))  # slices of MIN_PIECE rows or more
            if p >= parts:
                continue
            lo, hi = _ranges(dw.shape[1], parts)[p]
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


@functools.lru_cache(maxsize=16)
def grouped_mm_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch build has `grouped_mm` kernels (forward and weight gradient) for the device and dtype:
    one tiny forward + backward, remembered (a capability of the build, not a timing)."""
    from moebal.kernels.dispatch import make_plan

    dev = torch.device(device)
    plan = make_plan(torch.tensor([[0], [1], [1]], device=dev), None, 2)
    x = torch.ones(3, 16, device=dev, dtype=dtype, requires_grad=True)
    ws = [torch.ones(2, 16, 16, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)]
    try:
        with torch.enable_grad():
            swiglu_experts(x, ws[0], ws[1], ws[2], plan, "grouped_mm").sum().backward()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def auto_kernel(device: torch.device, dim: int, ffn: int, dtype: torch.dtype) -> KernelName:
    """`kernel="auto"`: `grouped_mm` on accelerators when it has a kernel for the dtype and the rows are aligned
    (no host sync, one launch per projection), the loop on CPU.

    A fixed rule, never a timing: the two back ends are not bitwise equal everywhere (multi-threaded MKL
    `grouped_mm` in fp32 at some shapes, and any GPU), so a measured choice made every process, every run and
    every restart pick differently and change the losses' last bits. On CPU the loop is never slower: with one
    intra-op thread both run the same per-expert GEMMs (CPU `grouped_mm` loops over the groups); with more,
    the loop's single-threaded workers avoid a barrier per small GEMM (docs/moe-layer.md has the figures).
    """
    if device.type != "cpu" and grouped_mm_supports(dim, ffn, dtype) and grouped_mm_runs(str(device), dtype):
        return "grouped_mm"
    return "loop"
