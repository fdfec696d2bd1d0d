"""Grouped SwiGLU experts over dispatched rows: y = w2(silu(w1 x) * w3 x) per expert (HF Mixtral maths).

One autograd Function runs the whole expert MLP so backward does only the work it needs: it saves the two
projections, the silu output and the product (as autograd would for a dense SwiGLU), reuses buffers in
place, and writes each expert's weight gradient straight into one stacked tensor.

Two back ends compute the per-expert matmuls on rows grouped by expert:
- `loop`: one `torch.mm(out=...)` per expert piece. On CPU the rows are split into contiguous ranges, one
  per intra-op thread, each run by a single-threaded worker (forward, then backward by rows, then weight
  gradients by output slices): three barriers per forward + backward instead of one per small GEMM.
  Needs the per-expert counts on the host.
- `grouped_mm`: `torch.nn.functional.grouped_mm` with int32 cumulative offsets (no host sync). On
  accelerators each expert's rows are first padded with zero rows to a multiple of 16 bytes' worth of rows
  (8 in bf16, 4 in fp32: the CUDA kernel's alignment of a group's start in the weight gradient), positions
  and offsets computed on the device (`padded_layout`); every pass runs in the padded buffer and the rows come
  back by one gather. On CPU the rows stay in place (no alignment needed; the bits stay the loop's).
`auto_kernel` is `kernel="auto"`'s rule (the loop on CPU, grouped_mm on accelerators when its probe passes,
else the loop with a warning that says why); a training run settles its one kernel at start-up and keeps it
(moebal/train/kernels.py).

On a CPU with MKL (AVX-512) the two back ends give the same bits with one intra-op thread, fp32 and bf16, every
pass, and the loop gives the same bits at any thread count (its workers never cut a sliver off an expert,
see `_row_ranges`); multi-threaded `grouped_mm` does not in fp32 at some shapes, and on GPUs they differ.

Shape legend: N dispatched rows grouped by expert, P rows of the padded buffer, E experts, D model dim, F expert
hidden dim.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

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
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], DispatchPlan]:
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
    return y, (x, h1, h3, s1, a), plan


def _loop_backward(g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   saved: tuple[torch.Tensor, ...], plan: DispatchPlan, need: tuple[bool, ...]
                   ) -> tuple[torch.Tensor | None, ...]:
    x, h1, h3, s1, a = saved
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

def grouped_mm_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Rows each group's size must be a multiple of for `grouped_mm` on `device` (1: no padding).

    torch's CUDA grouped GEMM (the weight gradient is 2D x 2D, groups along the reduction dim N) needs each
    group of a 2D operand to start on a 16-byte boundary, i.e. every group size but the last a multiple of
    16 / element size rows (8 in bf16, 4 in fp32). Which operands it checks depends on their layout and on the
    torch version (CUTLASS and cuBLAS paths), and the check is a device-side assert, which leaves the CUDA
    context unusable: padding satisfies every variant. Other accelerators get the same padding (harmless).
    CPU `grouped_mm` slices each group on the host and needs none; it stays unpadded so that it keeps the bits
    of the `loop` kernel (a BLAS may round a GEMM of a few rows differently from a taller one)."""
    if device.type == "cpu":
        return 1
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


@dataclass(frozen=True)
class GroupLayout:
    """Where `grouped_mm`'s groups lie in the buffer it multiplies: `offs_E` (int32 inclusive group ends) and,
    when padded, each dispatched row's row in the buffer of `rows` rows: `pos_N` where it is written, `src_N`
    where its result is read (they differ only for rows after the experts' rows, see `padded_layout`)."""

    offs_E: torch.Tensor
    pos_N: torch.Tensor | None
    src_N: torch.Tensor | None
    rows: int


def padded_layout(counts_E: torch.Tensor, num_rows: int, align: int) -> GroupLayout:
    """Each expert's rows padded with zero rows to a multiple of `align`, computed on the device (no host sync).

    Buffer (a static size, known without the counts), A = `align`, C = sum of the counts <= N = `num_rows`:
      [0, body)         the groups: expert e's rows first, then zero rows to a multiple of A; every group has
                        at least A rows (an empty expert A zero rows), so no GEMM has an empty dimension (a
                        kernel given an empty group may leave its output unwritten). The last group extends to
                        `body` = ceil(N / A) * A + (E + 1) * A, so `grouped_mm` writes every output row there;
                        its last A rows are always zero inputs (each padded count is at most count + A).
      [body, body + A)  trash: rows N - C after the experts' rows (an untrimmed plan's inactive assignments)
                        are written here, beyond the last offset, which no GEMM reads; their results are read
                        from row body - 1, a zero row: zero outputs and zero input gradients, exactly.
    Zero rows add exact zeros to the weight gradients.
    """
    E = counts_E.shape[0]
    body = -(-num_rows // align) * align + (E + 1) * align
    padded_E = torch.clamp(torch.div(counts_E + (align - 1), align, rounding_mode="floor"), min=1) * align
    end_E = torch.cumsum(counts_E, 0)
    pad_end_E = torch.cumsum(padded_E, 0)
    shift_E = (pad_end_E - padded_E) - (end_E - counts_E)  # padded start - dense start, per expert
    rows_N = torch.arange(num_rows, device=counts_E.device)
    expert_N = torch.searchsorted(end_E, rows_N, right=True)  # rows are grouped by expert; E: after them all
    pos_N = rows_N + torch.cat([shift_E, shift_E.new_zeros(1)])[expert_N]
    expert_row_N = expert_N < E
    # the last end set by a fill, not `offs[-1] = body`: a Python value assigned into a CUDA tensor is copied
    # from the host, a sync (seen by torch.cuda.set_sync_debug_mode on an H200)
    offs_E = torch.cat([pad_end_E[:-1], pad_end_E.new_full((1,), body)]).to(torch.int32)
    return GroupLayout(offs_E=offs_E, pos_N=torch.where(expert_row_N, pos_N, body),
                       src_N=torch.where(expert_row_N, pos_N, body - 1), rows=body + align)


def _layout(plan: DispatchPlan, x: torch.Tensor) -> GroupLayout:
    align = grouped_mm_alignment(x.device, x.dtype)
    if align == 1:
        return GroupLayout(offs_E=plan.offsets(), pos_N=None, src_N=None, rows=x.shape[0])
    return padded_layout(plan.counts_E, x.shape[0], align)


def _to_groups(t_N: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """Dispatched rows placed in the zero-filled buffer."""
    if layout.pos_N is None:
        return t_N
    return t_N.new_zeros((layout.rows, t_N.shape[1])).index_copy_(0, layout.pos_N, t_N)


def _from_groups(t_P: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """The dispatched rows' results back out of the buffer."""
    return t_P if layout.src_N is None else t_P.index_select(0, layout.src_N)


def _gmm(x_NI: torch.Tensor, w_EOI: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    return F.grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=layout.offs_E)


def _gmm_wgrad(g_NO: torch.Tensor, x_NI: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    return F.grouped_mm(g_NO.t(), x_NI, offs=layout.offs_E)


def _gmm_forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, plan: DispatchPlan
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], GroupLayout]:
    # every pass runs on the padded buffer: one scatter of x here and one gather of y, instead of padding the
    # five operands of the weight gradients in backward
    layout = _layout(plan, x)
    x_PD = _to_groups(x, layout)
    h1, h3 = _gmm(x_PD, w1, layout), _gmm(x_PD, w3, layout)
    s1 = F.silu(h1)
    a = s1 * h3
    return _from_groups(_gmm(a, w2, layout), layout), (x_PD, h1, h3, s1, a), layout


def _gmm_backward(g: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  saved: tuple[torch.Tensor, ...], layout: GroupLayout, need: tuple[bool, ...]
                  ) -> tuple[torch.Tensor | None, ...]:
    x_PD, h1, h3, s1, a = saved
    g = _to_groups(g, layout)  # zero rows in the padding: they add nothing to any weight gradient
    dw2 = _gmm_wgrad(g, a, layout) if need[3] else None
    da = _gmm(g, w2.transpose(1, 2), layout)  # g @ w2[e]
    dh3 = da * s1
    dh1 = torch.ops.aten.silu_backward(da.mul_(h3), h1)
    dw1 = _gmm_wgrad(dh1, x_PD, layout) if need[1] else None
    dw3 = _gmm_wgrad(dh3, x_PD, layout) if need[2] else None
    dx = None
    if need[0]:
        dx = _gmm(dh1, w1.transpose(1, 2), layout)
        dx = _from_groups(dx.add_(_gmm(dh3, w3.transpose(1, 2), layout)), layout)
    return dx, dw1, dw3, dw2


# (forward, backward) per kernel; the third value forward returns (the plan, or grouped_mm's padded layout) is
# the kernel's own and goes back to its backward unread, hence the open argument list
_Forward = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...], object]]
_Backward = Callable[..., tuple[torch.Tensor | None, ...]]
_IMPLS: dict[str, tuple[_Forward, _Backward]] = {"loop": (_loop_forward, _loop_backward),
                                                 "grouped_mm": (_gmm_forward, _gmm_backward)}


class _SwiGLUExperts(torch.autograd.Function):
    """Saves what a dense SwiGLU's autograd saves (x, both projections, silu output, product); backward
    allocates only the product gradient, one projection gradient, dx and the stacked weight gradients."""

    @staticmethod
    def forward(ctx: Any, x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                plan: DispatchPlan, kernel: str) -> torch.Tensor:
        y_ND, saved, layout = _IMPLS[kernel][0](x_ND, w1_EFD, w3_EFD, w2_EDF, plan)
        ctx.save_for_backward(w1_EFD, w3_EFD, w2_EDF, *saved)  # saved[0]: x (padded for grouped_mm)
        ctx.layout, ctx.kernel = layout, kernel
        return y_ND

    @staticmethod
    @once_differentiable  # a second derivative is refused by name, not by an out= error inside
    def backward(ctx: Any, g_ND: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w1_EFD, w3_EFD, w2_EDF, *saved = ctx.saved_tensors
        grads = _IMPLS[ctx.kernel][1](g_ND.contiguous(), w1_EFD, w3_EFD, w2_EDF, tuple(saved), ctx.layout,
                                      tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None)


def swiglu_experts(x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                   plan: DispatchPlan, kernel: KernelName) -> torch.Tensor:
    """y_ND = w2[e](silu(w1[e] x) * w3[e] x) for each row's expert e (rows grouped as in `plan`)."""
    if x_ND.shape[0] == 0 and grouped_mm_alignment(x_ND.device, x_ND.dtype) == 1:
        # unpadded grouped_mm rejects an empty operand; the loop yields empty rows and zero gradients (padded,
        # the buffer is never empty: no host read of the counts)
        kernel = "loop"
    y_ND: torch.Tensor = _SwiGLUExperts.apply(x_ND, w1_EFD, w3_EFD, w2_EDF, plan, kernel)  # apply is typed Any
    return y_ND


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


PROBE_COUNTS = (0, 1, 7, 13, 0, 3, 16, 2)
"""Rows per expert of the capability probe: empty groups (first, middle), unaligned sizes and an aligned one."""


def _probe_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """x_ND, w1, w3, w2 and the output gradient of the probe (a private generator: the run's RNG stays put)."""
    E, N, D, F_ = len(PROBE_COUNTS), sum(PROBE_COUNTS), 32, 48  # rows of 64 / 96 bytes in bf16: aligned
    gen = torch.Generator().manual_seed(0)
    shapes = ((N, D), (E, F_, D), (E, F_, D), (E, D, F_), (N, D))
    return [(torch.randn(s, generator=gen) * 0.5).to(dtype) for s in shapes]


@functools.lru_cache(maxsize=16)
def grouped_mm_probe(device: str, dtype: torch.dtype) -> str | None:
    """Why `grouped_mm` cannot serve this device and dtype, or None when it can: one forward + backward at
    PROBE_COUNTS through the kernel's own path (padding included), compared with a float64 reference on the
    CPU (output, input and weight gradients). Remembered: a capability of the build, not a timing."""
    from moebal.kernels.dispatch import make_plan

    x, w1, w3, w2, g = _probe_inputs(dtype)
    experts_N1 = torch.repeat_interleave(torch.arange(len(PROBE_COUNTS)), torch.tensor(PROBE_COUNTS)).unsqueeze(1)
    results = []
    runs: tuple[tuple[torch.device, KernelName | None], ...] = ((torch.device(device), "grouped_mm"),
                                                                (torch.device("cpu"), None))
    for where, kernel in runs:
        try:  # a build without the device's kernels (or without the device) raises; a device assert cannot be caught
            plan = make_plan(experts_N1.to(where), None, len(PROBE_COUNTS))
            leaves = [t.to(where, torch.float64 if kernel is None else dtype, copy=True).requires_grad_()
                      for t in (x, w1, w3, w2)]
            lx, l1, l3, l2 = leaves
            with torch.enable_grad(), torch.autocast(where.type, enabled=False):
                y = (swiglu_experts(lx, l1, l3, l2, plan, kernel) if kernel is not None
                     else reference_experts(lx, l1, l3, l2, plan))
                y.backward(g.to(where, y.dtype))
        except (RuntimeError, NotImplementedError, AssertionError) as e:
            lines = str(e).strip().splitlines()
            return f"{type(e).__name__}: {lines[0] if lines else ''}"
        grads = [leaf.grad for leaf in leaves]
        if any(g is None for g in grads):
            return f"the backward on {where} left an input without a gradient"
        results.append([t.detach().to("cpu", torch.float64) for t in (y, *grads) if t is not None])
    tol = 1e-2 if dtype == torch.float32 else 4e-2  # TF32 may be on in fp32; bf16 rounds each product
    for name, got, want in zip(("output", "dx", "dw1", "dw3", "dw2"), *results):
        err, scale = (got - want).abs().max().item(), max(1.0, want.abs().max().item())
        if not err <= tol * scale:  # also catches NaN
            return f"{name} differs from the float64 reference by {err:.3g} (tolerance {tol * scale:.3g})"
    return None


def grouped_mm_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether `grouped_mm` runs correctly on the device in the dtype (`grouped_mm_probe`)."""
    return grouped_mm_probe(device, dtype) is None


_noted: set[str] = set()


def _note_loop(device: torch.device, why: str) -> None:
    """Say once per reason why `auto` chose the loop on an accelerator (never a silent fallback)."""
    if why in _noted:
        return
    _noted.add(why)
    warnings.warn(f"moebal: expert kernel 'auto' uses the per-expert loop on {device}: {why}. The loop reads the "
                  f"per-expert row counts on the host (a sync per MoE layer) and launches one GEMM per expert and "
                  f"projection", RuntimeWarning, stacklevel=3)


def auto_kernel(device: torch.device, dim: int, ffn: int, dtype: torch.dtype) -> KernelName:
    """`kernel="auto"`: `grouped_mm` on accelerators when it has a kernel for the dtype and the rows are aligned
    (no host sync, one launch per projection), the loop on CPU. On an accelerator a choice of the loop is
    reported once per reason (a warning).

    A fixed rule, never a timing: the two back ends are not bitwise equal everywhere (multi-threaded MKL
    `grouped_mm` in fp32 at some shapes, and any GPU), so a measured choice made every process, every run and
    every restart pick differently and change the losses' last bits. On CPU the loop is never slower: with one
    intra-op thread both run the same per-expert GEMMs (CPU `grouped_mm` loops over the groups); with more,
    the loop's single-threaded workers avoid a barrier per small GEMM (docs/moe-layer.md has the figures).
    """
    if device.type == "cpu":
        return "loop"
    if not grouped_mm_supports(dim, ffn, dtype):
        size = torch.empty((), dtype=dtype).element_size()
        _note_loop(device, f"grouped_mm needs rows of 16 bytes' multiples, and dim={dim}, ffn={ffn} in {dtype} "
                           f"are not (make both multiples of {16 // size})")
        return "loop"
    why = grouped_mm_probe(str(device), dtype)
    if why is not None:
        _note_loop(device, f"grouped_mm failed its probe in {dtype} ({why})")
        return "loop"
    return "grouped_mm"
