"""Host syncs of the MoE path, counted through moebal.sync (the budget of docs/gpu.md), and the pieces that
keep it: sync-free plans, the completion pairing of the communication scheduler."""

from __future__ import annotations

import pytest
import torch

import moebal.models.moe as moe_module
from moebal.kernels.dispatch import make_plan
from moebal.models.moe import MoELayer
from moebal.scheduler.core import CommScheduler, HostCompletion, PollingCompletion, completion_for
from moebal.sync import audit, budget_report, count_ids, to_host, upload

VARIANTS = {
    "dropless": {},
    "capacity": {"capacity_factor": 1.0},
    "adaptive": {"adaptive_threshold": 0.2},
    "adaptive+capacity": {"adaptive_threshold": 0.2, "capacity_factor": 1.0},
    # DeepSeek-V3's gate: sigmoid scores, a selection bias, group-limited top-k, routed scaling
    "sigmoid+groups+bias": {"gate": "sigmoid_topk", "n_group": 4, "topk_group": 2, "group_score": "top2_sum",
                            "score_scale": 2.5, "selection_bias": True},
    # DeepSeek-V2's: softmax, group-limited greedy on each group's best score, weights not renormalised
    "softmax+groups": {"n_group": 4, "topk_group": 2, "norm_topk": False, "score_scale": 16.0},
}


def _layer(kernel: str, **kw) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(32, 48, 8, 2, kernel=kernel, z_loss_coef=0.001, **kw)


def _x() -> torch.Tensor:
    return torch.randn(4, 24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _syncs(layer: MoELayer, x: torch.Tensor) -> tuple[list[str], list[str]]:
    """Problems against the budget: forward, then backward."""
    with audit() as fwd:
        out = layer(x)
        loss = out.square().mean() + layer.aux_loss
    with audit() as bwd:
        loss.backward()
    budget = 0 if layer.experts.kernel == "grouped_mm" else 1  # the loop kernel reads its row counts
    return list(budget_report(fwd, budget, "forward")), list(budget_report(bwd, 0, "backward"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_device_grouped_mm_layer_makes_no_host_sync(variant):
    fwd, bwd = _syncs(_layer("grouped_mm", **VARIANTS[variant]), _x())
    assert fwd == [] and bwd == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_single_device_loop_layer_reads_its_counts_once(variant):
    layer = _layer("loop", **VARIANTS[variant])
    with audit() as a:
        layer(_x()).sum().backward()
    assert a.unaccounted == []
    assert dict(a.counted) == {"expert row counts": 1}


def test_an_item_added_to_the_hot_path_breaks_the_budget(monkeypatch):
    real = moe_module.combine

    def combine_with_a_sync(y_ND, plan, w_TK):
        plan.counts_E.sum().item()  # what a careless debug line would add
        return real(y_ND, plan, w_TK)

    monkeypatch.setattr(moe_module, "combine", combine_with_a_sync)
    fwd, _ = _syncs(_layer("grouped_mm"), _x())
    assert len(fwd) == 1 and "Tensor.item" in fwd[0] and "test_sync_budget.py" in fwd[0]


@pytest.mark.parametrize("variant", ["capacity", "adaptive", "adaptive+capacity"])
def test_masked_rows_give_the_trimmed_results(variant):
    """grouped_mm keeps inactive assignments as masked rows (no host read of their number); outputs and every
    gradient equal the loop kernel's on the trimmed rows (one intra-op thread: the same GEMMs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = []
        for kernel in ("loop", "grouped_mm"):
            layer, x = _layer(kernel, **VARIANTS[variant]), _x()
            out = layer(x)
            (out.square().mean() + layer.aux_loss).backward()
            results.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
    finally:
        torch.set_num_threads(threads)
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    assert torch.isfinite(o2).all() and torch.isfinite(gx2).all()
    torch.testing.assert_close(o2, o1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx2, gx1, rtol=1e-6, atol=1e-7)
    for a, b in zip(gp2, gp1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_untrimmed_plan_marks_the_active_rows():
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    active = torch.tensor([[True, False], [True, True], [False, True]])
    trimmed, masked = make_plan(idx, active, 3), make_plan(idx, active, 3, trim=False)
    assert trimmed.num_rows == 4 and masked.num_rows == 6
    assert masked.valid_N.tolist() == [True] * 4 + [False] * 2
    assert torch.equal(masked.order_N[:4], trimmed.order_N)
    assert masked.counts_E.tolist() == trimmed.counts_E.tolist() == [2, 1, 1]
    assert not masked.all_active
    rows = torch.full((6, 2), float("nan"))
    assert masked.mask_tail(rows)[4:].eq(0).all()


def test_helpers():
    ids = torch.tensor([3, 0, 3, 1])
    assert count_ids(ids, 5).tolist() == torch.bincount(ids, minlength=5).tolist()
    assert upload([1, 2], torch.device("cpu"), torch.int64).tolist() == [1, 2]
    with audit() as a:
        assert to_host(ids, "why") == [3, 0, 3, 1]
        ids.sum().item()
    assert dict(a.counted) == {"why": 1} and len(a.unaccounted) == 1 and a.syncs == 2
    assert torch.Tensor.item is torch._C.TensorBase.item  # unpatched after the audit


def test_completion_follows_the_device():
    assert isinstance(completion_for(torch.device("cpu")), HostCompletion)
    sched = CommScheduler("off", device="cpu")
    assert isinstance(sched.completion, HostCompletion) and not sched.completion.stream_wait
    sched.close()
    polling = PollingCompletion()
    try:
        assert polling.device_type == "cuda" and polling.stream_wait
        with pytest.raises(ValueError, match="observes cuda collectives"):
            CommScheduler("off", device="cpu", completion=polling)
    finally:
        polling.close()
    with pytest.raises(ValueError, match="observes cpu collectives"):
        CommScheduler("off", device="cuda", completion=HostCompletion())


def test_one_hardware_queue_is_refused_for_overlapping_schedulers(monkeypatch):
    from moebal.scheduler.core import _check_stream_concurrency

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        _check_stream_concurrency(torch.device("cuda"), "lina")
    _check_stream_concurrency(torch.device("cuda"), "off")  # one order on every rank: safe
    _check_stream_concurrency(torch.device("cpu"), "lina")  # gloo: no GPU queue
