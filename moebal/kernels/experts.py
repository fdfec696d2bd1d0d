"""Grouped SwiGLU experts over dispatched rows: y = w2(silu(w1 x) * w3 x) per expert (HF Mixtral maths).

One autograd Function runs the whole expert MLP so backward does only the work it needs: it saves the two
projections, the silu output and the product (as autograd would for a dense SwiGLU), reuses buffers in
place, and writes each expert's weight gradient straight into one stacked tensor.

Two GEMM back ends compute the per-expert matmuls on rows grouped by expert:
- `loop`: one `torch.mm` per non-empty expert slice (needs the per-expert counts on the host),
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

KernelName = Literal["loop", "grouped_mm"]
KERNELS: tuple[KernelName, ...] = ("loop", "grouped_mm")


# ---- GEMM back ends: out_NO = x_NI @ w_EOI[e]^T on expert e's rows, and the weight gradient g^T x ----

def _fwd_loop(x_NI: torch.Tensor, w_EOI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    out_NO = x_NI.new_empty((x_NI.shape[0], w_EOI.shape[1]))
    start = 0
    for e, n in enumerate(plan.host_counts()):
        if n:
            torch.mm(x_NI[start:start + n], w_EOI[e].t(), out=out_NO[start:start + n])
            start += n
    return out_NO


def _wgrad_loop(g_NO: torch.Tensor, x_NI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    counts = plan.host_counts()
    dw_EOI = g_NO.new_empty((len(counts), g_NO.shape[1], x_NI.shape[1]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(g_NO[start:start + n].t(), x_NI[start:start + n], out=dw_EOI[e])
            start += n
        else:
            dw_EOI[e].zero_()
    return dw_EOI


def _fwd_gmm(x_NI: torch.Tensor, w_EOI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    return F.grouped_mm(x_NI, w_EOI.transpose(1, 2), offs=plan.offsets())


def _wgrad_gmm(g_NO: torch.Tensor, x_NI: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    return F.grouped_mm(g_NO.t(), x_NI, offs=plan.offsets())


_BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "loop": (_fwd_loop, _wgrad_loop),
    "grouped_mm": (_fwd_gmm, _wgrad_gmm),
}


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,  # type: ignore[override]
                w2_EDF: torch.Tensor, plan: DispatchPlan, kernel: str) -> torch.Tensor:
        fwd, _ = _BACKENDS[kernel]
        h1_NF = fwd(x_ND, w1_EFD, plan)
        h3_NF = fwd(x_ND, w3_EFD, plan)
        s1_NF = F.silu(h1_NF)
        a_NF = s1_NF * h3_NF
        y_ND = fwd(a_NF, w2_EDF, plan)
        ctx.save_for_backward(x_ND, w1_EFD, w3_EFD, w2_EDF, h1_NF, h3_NF, s1_NF, a_NF)
        ctx.plan, ctx.kernel = plan, kernel
        return y_ND

    @staticmethod
    def backward(ctx, g_ND: torch.Tensor):  # type: ignore[override]
        x_ND, w1_EFD, w3_EFD, w2_EDF, h1_NF, h3_NF, s1_NF, a_NF = ctx.saved_tensors
        plan: DispatchPlan = ctx.plan
        fwd, wgrad = _BACKENDS[ctx.kernel]
        g_ND = g_ND.contiguous()
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        dw2 = wgrad(g_ND, a_NF, plan) if need_w2 else None
        da_NF = fwd(g_ND, w2_EDF.transpose(1, 2), plan)  # g @ w2[e]: w2^T is [E, F, D]^T -> rows of F
        dh3_NF = da_NF * s1_NF
        dh1_NF = torch.ops.aten.silu_backward(da_NF.mul_(h3_NF), h1_NF)
        dw1 = wgrad(dh1_NF, x_ND, plan) if need_w1 else None
        dw3 = wgrad(dh3_NF, x_ND, plan) if need_w3 else None
        dx = None
        if need_x:
            dx = fwd(dh1_NF, w1_EFD.transpose(1, 2), plan)
            dx.add_(fwd(dh3_NF, w3_EFD.transpose(1, 2), plan))
        return dx, dw1, dw3, dw2, None, None


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
