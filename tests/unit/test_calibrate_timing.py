"""Timing on an accelerator, tested on the CPU: the shared timing helper synchronises a CUDA device around every
timed call and runs it under the run's autocast; the live calibration (moebal/distributed/calibrate.py, packing.py)
times through it, the experts in the run's precision and the exchange's rows in that dtype.

CUDA is faked: `torch.cuda.synchronize` is replaced by a recorder, and the collectives by no-ops.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moebal.kernels import bench
from moebal.kernels.bench import sample_interleaved, time_fn, time_interleaved
from moebal.models.moe import SwiGLUExperts
from moebal.train.precision import autocast_dtype


@pytest.fixture
def fake_cuda(monkeypatch) -> list[Any]:
    """`torch.cuda.synchronize` recording its calls (the events list is shared with the timed functions)."""
    events: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    return events


def test_time_fn_brackets_every_timed_call_with_a_device_sync(fake_cuda) -> None:
    t = time_fn(lambda: fake_cuda.append("call"), warmup=2, repeats=3, device="cuda")
    assert t.repeats == 3
    warm, timed = fake_cuda[:2], fake_cuda[2:]
    assert warm == ["call", "call"]  # warm-up calls are not timed
    assert timed == [("sync", "cuda"), "call", ("sync", "cuda")] * 3  # launch-only timing is impossible


def test_no_device_sync_on_the_cpu(fake_cuda) -> None:
    time_interleaved({"a": lambda: None, "b": lambda: None}, warmup=1, repeats=2, device="cpu")
    time_fn(lambda: None, warmup=0, repeats=2)
    assert fake_cuda == []


def test_timed_calls_run_under_the_given_autocast() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    def probe() -> None:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    time_fn(probe, warmup=1, repeats=2, device="cpu", autocast=torch.bfloat16)
    assert seen == [(True, torch.bfloat16)] * 3  # warm-up and timed calls alike
    seen.clear()
    time_fn(probe, warmup=1, repeats=2, device="cpu")
    assert all(not on for on, _ in seen) and len(seen) == 3
    assert not torch.is_autocast_enabled("cpu")  # left as found
    with pytest.raises(ValueError, match="pass device"):
        time_fn(probe, autocast=torch.bfloat16)  # whose autocast? not guessed


def test_sample_interleaved_runs_before_outside_the_timed_region(fake_cuda) -> None:
    wall, cpu = sample_interleaved({"a": lambda: fake_cuda.append("a")}, warmup=0, repeats=2, device="cuda",
                                   before=lambda: fake_cuda.append("barrier"))
    assert fake_cuda == ["barrier", ("sync", "cuda"), "a", ("sync", "cuda")] * 2
    assert len(wall["a"]) == len(cpu["a"]) == 2 and min(wall["a"]) >= 0


def test_calibrate_round_robin_is_the_shared_helper(monkeypatch) -> None:
    from moebal.commands import calibrate

    calls: list[dict[str, Any]] = []
    real = bench.sample_interleaved

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(bench, "sample_interleaved", spy)
    out = calibrate.round_robin({"x": lambda: None}, 3, warmup=0)
    assert len(out["x"]) == 3 and calls and calls[0]["repeats"] == 3


def test_autocast_dtype_follows_the_run_precision() -> None:
    def cfg(p: str) -> Any:
        return SimpleNamespace(train=SimpleNamespace(precision=p))

    assert autocast_dtype(cfg("bf16"), torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype(cfg("fp32"), torch.device("cpu")) is None


# ---- the live calibration ------------------------------------------------------------------------------------

def _fake_dispatcher(compute_dtype: torch.dtype | None, E: int = 4, D: int = 16, F: int = 32) -> Any:
    ex = SwiGLUExperts(E, D, F, kernel="loop")
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.02)
    return SimpleNamespace(layer=SimpleNamespace(experts=ex), owned=list(range(E)), R=2, r=0, ep_ranks=[0, 1],
                           group=None, compute_dtype=compute_dtype, weights=None,
                           expert_flat=lambda e: torch.cat([w[e].reshape(-1) for w in ex.parameters()]))


def _watch(monkeypatch, ex: SwiGLUExperts) -> dict[str, list[Any]]:
    """Record the precision each expert computation runs in and the dtype each all-to-all sends; collectives
    are no-ops."""
    import torch.distributed as dist

    seen: dict[str, list[Any]] = {"compute": [], "a2a": []}
    real = ex.compute

    def compute(x: torch.Tensor, *a: Any) -> torch.Tensor:
        seen["compute"].append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real(x, *a)

    monkeypatch.setattr(ex, "compute", compute)
    def a2a(out: torch.Tensor, inp: torch.Tensor, **kw: Any) -> Any:
        seen["a2a"].append(inp.dtype)
        return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(dist, "all_to_all_single", a2a)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **kw: None)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [])
    monkeypatch.setattr(dist, "P2POp", lambda *a, **kw: None)
    return seen


@pytest.mark.parametrize("autocast", [torch.bfloat16, None])
def test_measure_layer_costs_times_the_run_precision(monkeypatch, autocast) -> None:
    """The dispatcher's compute dtype (bf16 under a bf16 run's autocast) is the precision timed."""
    from moebal.distributed import calibrate

    d = _fake_dispatcher(autocast)
    seen = _watch(monkeypatch, d.layer.experts)
    timed: list[Any] = []
    real = calibrate.time_fn

    def spy(fn: Any, **kw: Any) -> Any:
        timed.append(kw)
        return real(fn, **kw)

    monkeypatch.setattr(calibrate, "time_fn", spy)
    costs = calibrate.measure_layer_costs(d, 64, repeats=2)
    assert seen["compute"] and set(seen["compute"]) == {autocast}
    assert set(seen["a2a"]) == {autocast or torch.float32}  # the rows travel in the compute dtype
    assert costs.token_bytes == 16 * (2 if autocast else 4)
    assert costs.expert_param_bytes == 3 * 32 * 16 * 4  # what this fake's Trans sends (fp32)
    assert all(kw["device"] == torch.device("cpu") for kw in timed) and len(timed) == 3
    assert [kw["autocast"] for kw in timed] == [autocast, None, None]  # only compute runs under autocast


def test_measure_comm_costs_times_compute_under_autocast(monkeypatch) -> None:
    from moebal.distributed import calibrate
    from moebal.planner.perf import MoELayerCosts

    d = _fake_dispatcher(torch.bfloat16)
    seen = _watch(monkeypatch, d.layer.experts)
    layer = MoELayerCosts(token_bytes=32, expert_param_bytes=1e4, expert_grad_bytes=1e4, expert_tokens_per_s=1e6,
                          a2a_bandwidth=1e9, trans_bandwidth=1e9, agg_bandwidth=1e9, num_ranks=2)
    calibrate.measure_comm_costs(d, None, 64, layer, repeats=2)
    assert seen["compute"] and set(seen["compute"]) == {torch.bfloat16}
    assert torch.bfloat16 in seen["a2a"]  # the step-sized exchange (the 8-byte latency probe stays fp32)


def test_packing_layout_times_run_synchronised_in_the_run_precision(monkeypatch) -> None:
    from moebal.balance import packing
    from moebal.distributed import calibrate

    d = _fake_dispatcher(None)
    ex = d.layer.experts
    seen = _watch(monkeypatch, ex)
    devices: list[Any] = []
    real = calibrate.time_fn

    def spy(fn: Any, **kw: Any) -> Any:
        devices.append(kw["device"])
        return real(fn, **kw)

    monkeypatch.setattr(calibrate, "time_fn", spy)
    dims = SimpleNamespace(group=lambda axis: None)
    times = [packing._layout_times(ex, dims, ep, 64, torch.Generator().manual_seed(0), torch.bfloat16, 1.0)
             for ep in (2, 1)]
    assert times[1][1] == 0.0 and all(t[0] > 0 for t in times)  # one rank per group: no exchange
    assert set(seen["compute"]) == {torch.bfloat16} and seen["a2a"] and set(seen["a2a"]) == {torch.bfloat16}
    assert devices == [torch.device("cpu")] * 3  # every figure through the synchronising helper
