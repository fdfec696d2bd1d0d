"""Kernels against plain references: the dispatch plan, dispatch/combine, fused SwiGLU experts, timing helper.

Shape legend: T tokens, K top_k, E experts, N dispatched rows, D dim, F expert hidden dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moebal.kernels import (
    KERNELS,
    auto_kernel,
    combine,
    dispatch,
    make_plan,
    reference_experts,
    swiglu_experts,
    time_interleaved,
)
from moebal.kernels import expert_ffn as experts_mod
from moebal.kernels.expert_ffn import (
    MIN_PIECE,
    _row_ranges,
    grouped_mm_alignment,
    grouped_mm_runs,
    grouped_mm_supports,
    padded_layout,
)
from moebal.models import moe as moe_mod
from moebal.models.moe import SwiGLUExperts
from moebal.routing import GateSpec, route

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def test_plan_by_hand() -> None:
    idx_TK = torch.tensor([[2, 0], [0, 1], [2, 1]])
    plan = make_plan(idx_TK, None, 4)
    assert plan.counts_E.tolist() == [2, 2, 2, 0]
    assert plan.order_N.tolist() == [1, 2, 3, 5, 0, 4]  # flat t * K + j, grouped by expert, token order kept
    assert plan.token_N.tolist() == [0, 1, 1, 2, 0, 2]
    assert plan.offsets().tolist() == [2, 4, 6, 6]
    active_TK = torch.tensor([[True, False], [True, True], [False, True]])
    plan = make_plan(idx_TK, active_TK, 4)
    assert plan.counts_E.tolist() == [1, 2, 1, 0]
    assert plan.token_N.tolist() == [1, 1, 2, 0]


@pytest.mark.parametrize("how", ["by hand", "capacity", "adaptive"])
def test_an_untrimmed_plan_marks_exactly_the_active_assignments_valid(how: str) -> None:
    """`trim=False` keeps every row and marks as valid the first n, n the number of active assignments: one row
    more would let a kernel's unwritten tail row (anything, NaN included) into the output."""
    if how == "by hand":
        idx_TK = torch.tensor([[2, 0], [0, 1], [2, 1]])
        active_TK = torch.tensor([[True, False], [True, True], [False, True]])
        E = 4
    else:
        g = torch.Generator().manual_seed(5)
        E = 4
        spec = GateSpec(num_experts=E, top_k=2, **({"capacity_factor": 0.5} if how == "capacity"
                                                   else {"adaptive_threshold": 0.3}))
        r = route(torch.randn(24, E, generator=g) * 2, spec)
        idx_TK, active_TK = r.indices_TK, r.active_TK
    assert active_TK is not None and 0 < int(active_TK.sum()) < active_TK.numel()
    n = int(active_TK.sum())
    plan = make_plan(idx_TK, active_TK, E, trim=False)
    assert plan.valid_N is not None and plan.valid_N.shape == (active_TK.numel(),)
    assert plan.valid_N.tolist() == [True] * n + [False] * (active_TK.numel() - n)
    assert int(plan.counts_E.sum()) == n


def test_a_kernels_unwritten_tail_rows_never_reach_the_layer_output(monkeypatch) -> None:
    """A grouped kernel on an untrimmed plan may leave the inactive assignments' rows as they were (torch.empty:
    NaN here); with capacity drops the layer's output and gradients stay finite."""
    real = moe_mod.swiglu_experts

    def kernel(x, w1, w3, w2, plan, name):
        y = real(x, w1, w3, w2, plan, name)
        n = int(plan.counts_E.sum())
        return torch.cat([y[:n], torch.full_like(y[n:], float("nan"))])

    monkeypatch.setattr(moe_mod, "swiglu_experts", kernel)
    torch.manual_seed(0)
    layer = moe_mod.MoELayer(32, 16, 4, 2, capacity_factor=0.5, kernel="grouped_mm")
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = layer(x)
    assert int(layer.last_stats.dropped) > 0
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dispatch_and_combine_against_dense_formula() -> None:
    torch.manual_seed(0)
    T, K, E, D = 5, 2, 3, 4
    idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    active_TK = torch.rand(T, K) > 0.3
    w_TK = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    x_TD = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    plan = make_plan(idx_TK, active_TK, E)
    scale_E = torch.arange(1.0, E + 1, dtype=torch.float64)
    expert_N = idx_TK.reshape(-1)[plan.order_N]
    out_TD = combine(dispatch(x_TD, plan) * scale_E[expert_N, None], plan, w_TK)
    ref_TD = ((w_TK * active_TK * scale_E[idx_TK]).sum(-1, keepdim=True)) * x_TD
    torch.testing.assert_close(out_TD, ref_TD)
    assert torch.autograd.gradcheck(
        lambda x, w: combine(dispatch(x, plan) * scale_E[expert_N, None], plan, w), (x_TD, w_TK))


@pytest.mark.parametrize("op", ["dispatch", "experts", "combine"])
def test_a_second_derivative_is_refused_by_name(op: str) -> None:
    """The kernels' backward passes are first derivatives only: create_graph=True through one of them names that,
    where it used to fail inside the backward on an out= argument."""
    torch.manual_seed(0)
    T, K, E, D, F = 4, 2, 3, 8, 16
    idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    plan = make_plan(idx_TK, None, E)
    x_TD = torch.randn(T, D, requires_grad=True)
    w1, w3, w2 = (torch.randn(E, F, D, requires_grad=True), torch.randn(E, F, D, requires_grad=True),
                  torch.randn(E, D, F, requires_grad=True))
    w_TK = torch.rand(T, K, requires_grad=True)
    x_ND = dispatch(x_TD, plan) if op == "dispatch" else dispatch(x_TD, plan).detach().requires_grad_(True)
    y_ND = swiglu_experts(x_ND, w1, w3, w2, plan, "loop") if op == "experts" else x_ND * 2.0
    out = combine(y_ND, plan, w_TK) if op == "combine" else y_ND.sum(dim=1)
    g = torch.autograd.grad(out.square().sum(), x_ND if op == "experts" else
                            (w_TK if op == "combine" else x_TD), create_graph=True)[0]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_experts_match_autograd_reference(kernel: str) -> None:
    torch.manual_seed(1)
    E, D, F = 4, 8, 12
    idx_T1 = torch.tensor([[0], [3], [3], [0], [3], [1], [0]])  # expert 2 empty
    plan = make_plan(idx_T1, None, E)
    x = torch.randn(7, D)
    ws = [torch.randn(E, F, D) * 0.3, torch.randn(E, F, D) * 0.3, torch.randn(E, D, F) * 0.3]
    g = torch.randn(7, D)
    outs = {}
    for name, fn in (("fused", lambda *a: swiglu_experts(*a, plan, kernel)), ("ref", lambda *a: reference_experts(
            *a, plan))):
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        y = fn(*leaves)
        y.backward(g)
        outs[name] = (y.detach(), *[t.grad for t in leaves])
    for a, b in zip(outs["fused"], outs["ref"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert outs["fused"][3][2].abs().sum() == 0  # empty expert: zero gradient


def test_fused_experts_gradcheck_float64() -> None:
    torch.manual_seed(2)
    plan = make_plan(torch.tensor([[1], [0], [1], [1]]), None, 3)
    args = [torch.randn(4, 3, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 5, 3, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 5, 3, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 3, 5, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda *a: swiglu_experts(*a, plan, "loop"), args)


@settings(max_examples=12, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=6), data=st.data())
def test_grouped_mm_equals_loop(counts: list[int], data: st.DataObject) -> None:
    D, F = data.draw(st.sampled_from([4, 8])), data.draw(st.sampled_from([4, 12]))
    E = len(counts)
    idx_T1 = torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).unsqueeze(1)
    idx_T1 = idx_T1[torch.randperm(idx_T1.shape[0], generator=torch.Generator().manual_seed(sum(counts)))]
    plan = make_plan(idx_T1, None, E)
    gen = torch.Generator().manual_seed(E * 13 + D)
    x = torch.randn(idx_T1.shape[0], D, generator=gen)
    ws = [torch.randn(E, F, D, generator=gen), torch.randn(E, F, D, generator=gen), torch.randn(E, D, F, generator=gen)]
    results = []
    for kernel in KERNELS:
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        y = swiglu_experts(*leaves, plan, kernel)
        y.sum().backward()
        results.append((y.detach(), *[t.grad for t in leaves]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_kernel_is_a_rule_not_a_timing(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert grouped_mm_runs("cpu", torch.float32) and grouped_mm_runs("cpu", torch.bfloat16)
    experts = SwiGLUExperts(8, 256, 512)  # kernel "auto"
    for dtype in (torch.float32, torch.bfloat16):
        assert auto_kernel(cpu, 256, 512, dtype) == "loop"
        # no row count changes the choice (the former per-size timing did, and so changed the losses)
        assert {experts.resolve_kernel(rows, dtype) for rows in (16, 4096, 1 << 16)} == {"loop"}
    assert grouped_mm_supports(64, 128, torch.float32) and not grouped_mm_supports(6, 128, torch.float32)
    # accelerators: grouped_mm where torch has a kernel and the rows are 16-byte aligned, else the loop
    gpu = torch.device("cuda")
    monkeypatch.setattr(experts_mod, "grouped_mm_probe",
                        lambda device, dtype: None if dtype == torch.bfloat16 else "RuntimeError: no kernel")
    monkeypatch.setattr(experts_mod, "_noted", set())
    assert auto_kernel(gpu, 64, 128, torch.bfloat16) == "grouped_mm"
    with pytest.warns(RuntimeWarning, match="dim=130, ffn=130 .* multiples of 8"):
        assert auto_kernel(gpu, 130, 130, torch.bfloat16) == "loop"  # 260-byte rows
    with pytest.warns(RuntimeWarning, match="failed its probe in torch.float32 .RuntimeError: no kernel"):
        assert auto_kernel(gpu, 64, 128, torch.float32) == "loop"  # no kernel for the dtype


def test_auto_kernel_says_once_why_it_takes_the_loop_on_an_accelerator(monkeypatch) -> None:
    import warnings

    monkeypatch.setattr(experts_mod, "grouped_mm_probe", lambda device, dtype: "RuntimeError: no kernel")
    monkeypatch.setattr(experts_mod, "_noted", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):  # a layer resolves its kernel every call: one warning per reason, not per call
            assert auto_kernel(torch.device("cuda"), 64, 128, torch.bfloat16) == "loop"
            assert auto_kernel(torch.device("cuda"), 6, 128, torch.bfloat16) == "loop"
            assert auto_kernel(torch.device("cpu"), 64, 128, torch.bfloat16) == "loop"  # the CPU rule: silent
    assert len(seen) == 2 and all(issubclass(w.category, RuntimeWarning) for w in seen)
    assert "probe" in str(seen[0].message) and "dim=6" in str(seen[1].message)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 90), min_size=1, max_size=8), parts=st.integers(1, 5))
def test_worker_ranges_never_cut_a_sliver_off_an_expert(counts: list[int], parts: int) -> None:
    N = sum(counts)
    ranges = _row_ranges(counts, N, parts)
    assert [r for lo, hi in ranges for r in range(lo, hi)] == list(range(N))  # contiguous, complete
    starts = [sum(counts[:e]) for e in range(len(counts) + 1)]
    for lo, hi in ranges:
        for e, n in enumerate(counts):
            piece = min(hi, starts[e + 1]) - max(lo, starts[e])
            assert piece <= 0 or piece == n or piece >= MIN_PIECE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_is_bitwise_grouped_mm_and_the_same_at_any_thread_count(dtype: torch.dtype) -> None:
    """Every pass (output, input and weight gradients) bit for bit, so a run's kernel choice changes nothing
    here; the counts put a 2-worker boundary 2 rows into expert 1 and give expert 2 only 2 rows."""
    counts = [298, 100, 2, 200]
    E, D, F = len(counts), 64, 96
    plan = make_plan(torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).unsqueeze(1), None, E)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), D, generator=gen).to(dtype)
    ws = [(torch.randn(E, a, b, generator=gen) * 0.05).to(dtype) for a, b in ((F, D), (F, D), (D, F))]
    g = torch.randn(sum(counts), D, generator=gen).to(dtype)

    def run(kernel: str, threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        leaves = [t.clone().requires_grad_() for t in (x, *ws)]
        y = swiglu_experts(*leaves, plan, kernel)  # type: ignore[arg-type]
        y.backward(g)
        return [y.detach(), *[t.grad for t in leaves]]

    reference = run("grouped_mm", 1)
    for kernel, threads in (("loop", 1), ("loop", 2)):
        for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), run(kernel, threads), reference):
            assert torch.equal(a, b), (kernel, threads, name, (a.float() - b.float()).abs().max().item())


def test_time_interleaved_counts_calls_and_orders_stats() -> None:
    calls = {"a": 0, "b": 0}

    def make(name: str):
        def fn() -> None:
            calls[name] += 1
        return fn

    out = time_interleaved({"a": make("a"), "b": make("b")}, warmup=2, repeats=5)
    assert calls == {"a": 7, "b": 7}
    for t in out.values():
        assert t.repeats == 5 and 0 <= t.min <= t.median <= t.max


@pytest.mark.parametrize("threads, masked", [(2, False), (3, False), (2, True)])
def test_threaded_row_split_matches_reference(threads: int, masked: bool) -> None:
    """Enough rows that the CPU workers split them (ranges cut through experts, one expert empty)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        T, K, E, D, F = 300, 2, 5, 8, 12
        probs = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05])
        idx_TK = torch.stack([torch.multinomial(probs, K, generator=gen) for _ in range(T)])
        active_TK = None
        if masked:  # dropped or not-taken assignments: the scatter-add paths
            active_TK = torch.rand(T, K, generator=gen) > 0.3
        plan = make_plan(idx_TK, active_TK, E)
        assert plan.counts_E[2] == 0 and plan.all_active == (not masked)
        x = torch.randn(T, D, generator=gen)
        w_TK = torch.rand(T, K, generator=gen)
        ws = [torch.randn(E, F, D, generator=gen) * 0.3, torch.randn(E, F, D, generator=gen) * 0.3,
              torch.randn(E, D, F, generator=gen) * 0.3]
        g = torch.randn(T, D, generator=gen)
        outs = []
        for fused in (True, False):
            leaves = [t.clone().requires_grad_() for t in (x, w_TK, *ws)]
            x_ND = dispatch(leaves[0], plan)
            if fused:
                y_ND = swiglu_experts(x_ND, *leaves[2:], plan, "loop")
                out = combine(y_ND, plan, leaves[1])
            else:  # plain autograd: fancy indexing, per-expert loop, index_add
                x_ND = leaves[0][plan.token_N]
                y_ND = reference_experts(x_ND, *leaves[2:], plan)
                w_N = leaves[1].reshape(-1)[plan.order_N]
                out = torch.zeros(T, D).index_add(0, plan.token_N, y_ND * w_N[:, None])
            out.backward(g)
            outs.append((out.detach(), *[t.grad for t in leaves]))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.get_num_threads() == threads  # the workers restore the intra-op thread count
    finally:
        torch.set_num_threads(previous)


def test_run_parallel_propagates_errors_and_restores_threads() -> None:
    from moebal.kernels.workers import run_parallel

    previous = torch.get_num_threads()
    seen: list[int] = []

    def ok() -> None:
        seen.append(torch.get_num_threads())

    def bad() -> None:
        raise RuntimeError("task failed")

    with pytest.raises(RuntimeError, match="task failed"):
        run_parallel([ok, bad, ok])
    assert torch.get_num_threads() == previous
    run_parallel([ok, ok])
    assert seen and all(n == 1 for n in seen)  # each task ran with one intra-op thread


# ---- grouped_mm with padded groups (the CUDA layout, run here on the CPU) ------------------------------------

UNALIGNED = [0, 1, 7, 13, 0, 300, 5, 33]


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=9), align=st.sampled_from([2, 4, 8]),
       extra=st.integers(0, 12))
def test_padded_layout_aligns_every_group_and_keeps_row_order(counts: list[int], align: int, extra: int) -> None:
    """`extra` rows after the experts' rows: an untrimmed plan's inactive assignments."""
    N = sum(counts) + extra
    layout = padded_layout(torch.tensor(counts), N, align)
    offs = layout.offs_E.tolist()
    assert layout.offs_E.dtype == torch.int32 and offs[-1] == layout.rows - align
    assert layout.rows == -(-N // align) * align + (len(counts) + 2) * align  # static: known without the counts
    starts = [0, *offs[:-1]]
    assert all(o % align == 0 for o in offs)  # every group starts (and ends) on an aligned row
    assert all(e - s >= max(n, 1) for s, e, n in zip(starts, offs, counts))  # no group empty, none cut
    dense = [s for n, s in zip(counts, starts) for s in range(s, s + n)]
    pos, src = layout.pos_N.tolist(), layout.src_N.tolist()
    assert pos[:sum(counts)] == src[:sum(counts)] == dense  # expert e's rows first in its group, in order
    assert all(p >= offs[-1] for p in pos[sum(counts):])  # inactive rows: beyond every group (never read)
    last_rows = set(range(offs[-1] - align, offs[-1]))
    assert not last_rows & set(dense) and all(r in last_rows for r in src[sum(counts):])  # ... results: zero


@pytest.fixture
def padded(monkeypatch):
    """grouped_mm with the CUDA layout on the CPU: groups padded to 16 bytes' worth of rows."""
    monkeypatch.setattr(experts_mod, "grouped_mm_alignment", lambda device, dtype: 16 // dtype.itemsize)


def _expert_case(counts: list[int], dtype: torch.dtype, D: int = 32, F: int = 48):
    E = len(counts)
    plan = make_plan(torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).unsqueeze(1), None, E)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(counts), D, generator=gen).to(dtype)
    ws = [(torch.randn(E, a, b, generator=gen) * 0.2).to(dtype) for a, b in ((F, D), (F, D), (D, F))]
    g = torch.randn(sum(counts), D, generator=gen).to(dtype)
    return plan, x, ws, g


def _passes(fn, x, ws, g) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    y = fn(*leaves)
    y.backward(g)
    return [y.detach(), *[t.grad for t in leaves]]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_padded_grouped_mm_matches_reference_and_loop_at_unaligned_counts(padded, dtype, tol) -> None:
    """Forward, input and every weight gradient against a float64 reference and the loop (errors relative to
    the largest value of each result: 2^-8 per bf16 rounding, sums over up to 300 rows)."""
    plan, x, ws, g = _expert_case(UNALIGNED, dtype)
    got = _passes(lambda *a: swiglu_experts(*a, plan, "grouped_mm"), x, ws, g)
    loop = _passes(lambda *a: swiglu_experts(*a, plan, "loop"), x, ws, g)
    ref = _passes(lambda *a: reference_experts(*[t.double() for t in a], plan), x, ws, g)
    for name, a, b, r in zip(("y", "dx", "dw1", "dw3", "dw2"), got, loop, ref):
        assert a.dtype == dtype and a.shape == b.shape == r.shape, name
        scale = r.abs().max().item()
        assert (a.double() - r).abs().max().item() <= tol * scale, name
        assert (a.double() - b.double()).abs().max().item() <= tol * scale, name
    for e in (0, 4):  # the empty experts: exactly zero weight gradients (their groups are all padding)
        assert all(w[e].abs().sum() == 0 for w in got[2:])


def test_unpadded_cpu_grouped_mm_keeps_its_bits() -> None:
    """On the CPU the path is unchanged (no padding): bit for bit the loop's, so the layout costs nothing here."""
    assert grouped_mm_alignment(torch.device("cpu"), torch.bfloat16) == 1
    assert grouped_mm_alignment(torch.device("cuda"), torch.bfloat16) == 8
    assert grouped_mm_alignment(torch.device("cuda"), torch.float32) == 4
    plan, x, ws, g = _expert_case(UNALIGNED, torch.bfloat16)
    a = _passes(lambda *t: swiglu_experts(*t, plan, "grouped_mm"), x, ws, g)
    b = _passes(lambda *t: swiglu_experts(*t, plan, "loop"), x, ws, g)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_padded_grouped_mm_of_an_untrimmed_plan(padded) -> None:
    """A plan made without a host sync keeps the inactive assignments as rows after the experts' rows: they get
    zero outputs and zero input gradients, and no weight gradient sees them (whatever they hold)."""
    plan, x, ws, g = _expert_case(UNALIGNED, torch.float32)
    tail = torch.randn(37, x.shape[1]) * 1e3
    got = _passes(lambda *a: swiglu_experts(*a, plan, "grouped_mm"), torch.cat([x, tail]), ws, torch.cat([g, tail]))
    ref = _passes(lambda *a: swiglu_experts(*a, plan, "grouped_mm"), x, ws, g)
    N = x.shape[0]
    assert got[0][N:].eq(0).all() and got[1][N:].eq(0).all()
    for a, b in zip(got, ref):
        assert torch.equal(a[:N] if a.shape[0] > N and a.dim() == 2 else a, b)


@pytest.mark.parametrize("counts", [UNALIGNED, [0, 0, 0]])
def test_grouped_mm_path_reads_nothing_on_the_host(padded, monkeypatch, counts: list[int]) -> None:
    """Forward and backward of the padded path (also with no rows at all) without a single host read: the
    offsets, positions and padding are computed on the device."""
    from moebal import sync

    plan, x, ws, g = _expert_case(counts, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    writes: list[object] = []
    real_setitem = torch.Tensor.__setitem__

    def setitem(self, index, value):  # `t[i] = 3` copies 3 from the host: a sync on CUDA, unseen by the audit
        writes.append(value)
        return real_setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    with sync.audit() as a:
        swiglu_experts(*leaves, plan, "grouped_mm").backward(g)
    assert a.syncs == 0 and writes == [], (a, writes)
    assert all(t.grad is not None for t in leaves)
    with sync.audit() as a:  # the audit does see the loop's read of the counts
        swiglu_experts(*[t.detach() for t in leaves], plan, "loop")
    assert a.syncs == 1, a


def test_probe_runs_unaligned_groups_and_catches_wrong_results(padded, monkeypatch) -> None:
    probe = experts_mod.grouped_mm_probe.__wrapped__  # uncached
    assert experts_mod.PROBE_COUNTS.count(0) >= 2 and any(n % 8 for n in experts_mod.PROBE_COUNTS)
    assert probe("cpu", torch.bfloat16) is None and probe("cpu", torch.float32) is None
    calls: list[torch.Tensor] = []
    real = torch.nn.functional.grouped_mm

    def wrong(a, b, *, offs):  # a kernel whose forward results are off by 3 %
        calls.append(offs)
        out = real(a, b, offs=offs)
        return out * 1.03 if b.dim() == 3 else out

    monkeypatch.setattr(experts_mod.F, "grouped_mm", wrong)
    assert "differs from the float64 reference" in probe("cpu", torch.bfloat16)
    assert any((o % 8 == 0).all() and o.shape[0] == len(experts_mod.PROBE_COUNTS) for o in calls)

    def broken(a, b, *, offs):
        raise RuntimeError("no kernel for this GPU\nmore detail")

    monkeypatch.setattr(experts_mod.F, "grouped_mm", broken)
    assert probe("cpu", torch.bfloat16) == "RuntimeError: no kernel for this GPU"


def test_the_expert_worker_pool_only_grows_and_shuts_down_what_it_outgrows(monkeypatch):
    from moebal.kernels import workers

    monkeypatch.setattr(workers, "_pool", None)  # a fresh pool, whatever earlier tests made
    monkeypatch.setattr(workers, "_pool_key", (0, 0))

    def nothing() -> None:
        pass

    workers.run_parallel([nothing] * 3)
    first = workers._executor(2)
    assert workers._executor(1) is first  # a smaller call reuses the pool
    workers.run_parallel([nothing] * 4)  # needs 3 workers: a new pool; the one it outgrew is shut down
    grown = workers._executor(3)
    assert grown is not first and first._shutdown
    for _ in range(5):
        workers.run_parallel([nothing] * 2)
        workers.run_parallel([nothing] * 4)
    assert workers._executor(3) is grown and len(grown._threads) <= 3
    for t in list(first._threads):
        t.join(timeout=5)
        assert not t.is_alive()  # the outgrown pool's threads exited
