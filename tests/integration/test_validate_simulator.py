"""`scripts/validate_simulator.py --quick` end to end (a subprocess: its JSON structure and its out-of-sample
check, not its timing values), and the pieces the check rests on: the shape recorder sees the GEMMs and
collectives a call runs, the disjointness check refuses a shared shape, the probe grid cannot meet the workload
grid, and the Spearman rank correlation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cli_util import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "validate_simulator.py"


def _module():
    return load_script("validate_simulator")


@pytest.mark.slow
def test_quick_run_writes_every_record_and_checks_disjointness(tmp_path):
    out = tmp_path / "val.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    records = json.loads(out.read_text(encoding="utf-8"))
    side = json.loads(out.with_suffix(".summary.json").read_text(encoding="utf-8"))
    assert {rec["mode"] for rec in records} == {"single", "ep", "scheduled", "pipeline", "collective"}
    for rec in records:
        assert rec["measured_s"] > 0 and rec["predicted_s"] > 0, rec["name"]
        assert rec["error"] == pytest.approx((rec["predicted_s"] - rec["measured_s"]) / rec["measured_s"])
        assert rec["config"]["mode"] == rec["mode"] and rec["load_average"] >= 0
        assert [s["round"] for s in rec["samples"]] == [0, 1]  # --quick: 2 rounds, every one recorded
        for s in rec["samples"]:
            assert s["error"] == pytest.approx((rec["predicted_s"] - s["measured_s"]) / s["measured_s"])
            assert s["load_average"] >= 0
    pipe = next(rec for rec in records if rec["mode"] == "pipeline")
    assert len(pipe["runner_step_time_s"]) == 2 and min(pipe["runner_step_time_s"]) > 0
    summary = side["summary"]
    steps = [rec for rec in records if rec["mode"] != "collective"]
    assert summary["steps"]["runs"] == len(steps) == 4 and summary["steps"]["samples"] == 8
    errs = np.abs([s["error"] for rec in steps for s in rec["samples"]])
    assert summary["steps"]["median_abs_error"] == pytest.approx(float(np.median(errs)))
    assert summary["steps"]["p90_abs_error"] == pytest.approx(float(np.percentile(errs, 90)))
    assert "spearman" in summary["steps"] and set(summary["by_mode"]) == {"single", "ep", "scheduled", "pipeline",
                                                                         "collective"}
    # the out-of-sample check ran on the shapes the probes and the workloads executed
    dis = side["disjointness"]
    for kind in ("gemm", "attention", "collective"):
        assert dis[kind]["common"] == [] and dis[kind]["probe_shapes"] > 0 and dis[kind]["workload_shapes"] > 0
    assert side["fitted_profiles"]["single_process"]["flops"]["fp32"] > 0


def test_shape_log_records_gemms_and_collectives_and_a_shared_shape_is_refused():
    import torch
    import torch.nn.functional as F

    vs = _module()
    probe, work = vs.ShapeLog(), vs.ShapeLog()
    with probe.record():
        F.linear(torch.randn(80, 336), torch.randn(720, 336))
    with work.record():
        x = torch.randn(4, 256, 256, requires_grad=True)
        F.linear(x, torch.randn(768, 256, requires_grad=True)).sum().backward()
    assert probe.gemm == {(80, 336, 720)}
    # forward x W^T, dgrad dy W, wgrad dy^T x
    assert work.gemm == {(1024, 256, 768), (1024, 768, 256), (768, 1024, 256)}
    ok = vs.disjointness(probe.as_json(), work.as_json())
    assert ok["gemm"]["common"] == [] and ok["gemm"]["probe_shapes"] == 1
    with probe.record():  # a probe that runs a workload shape
        F.linear(torch.randn(4, 256, 256), torch.randn(768, 256))
    with pytest.raises(AssertionError, match="not out of sample"):
        vs.disjointness(probe.as_json(), work.as_json())
    with pytest.raises(AssertionError, match="collective"):
        vs.disjointness({"collective": [4_000_000]}, {"collective": [4_000_000, 16]})


def test_collectives_are_recorded_from_torch_distributed_calls(monkeypatch):
    import torch
    import torch.distributed as dist

    vs = _module()
    seen = []
    def fake(t, *a, **k):
        seen.append(t.numel())

    monkeypatch.setattr(dist, "all_reduce", fake, raising=False)
    log = vs.ShapeLog()
    with log.record():
        dist.all_reduce(torch.ones(1000))
    assert seen == [1000] and log.collective == {4000}
    assert dist.all_reduce is fake  # restored after the recording


def test_probe_grid_cannot_meet_the_workload_grid(monkeypatch):
    vs = _module()
    vs.check_grid()
    for case in vs.STEP_CASES:  # every workload dimension a multiple of 32
        assert case["seq"] % 32 == 0 and case["model"]["dim"] % 32 == 0
    assert len(vs.STEP_CASES) >= 20 and len(vs.SHAPES) >= 4
    assert {c["mode"] for c in vs.STEP_CASES} == {"single", "ep", "scheduled", "pipeline"}
    monkeypatch.setattr(vs, "PROBE_GEMM", vs.PROBE_GEMM + [(1024, 768, 256)])
    with pytest.raises(AssertionError, match="probe dimensions"):
        vs.check_grid()


def test_spearman_with_ties():
    vs = _module()
    assert vs.spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert vs.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks [0, 1.5, 1.5, 3] and [0, 2, 1, 3]: Pearson 4.5 / sqrt(4.5 * 5)
    assert vs.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    assert vs.spearman([1, 1, 1], [1, 2, 3]) is None


def test_pool_summarises_every_record_of_several_runs(tmp_path, capsys):
    vs = _module()

    def rec(mode, pred, meas):
        return {"name": f"{mode} {pred}", "mode": mode, "predicted_s": pred, "measured_s": float(np.median(meas)),
                "error": (pred - float(np.median(meas))) / float(np.median(meas)),
                "samples": [{"round": i, "measured_s": m, "error": (pred - m) / m, "load_average": 1.0 + i}
                            for i, m in enumerate(meas)]}

    a = [rec("single", 1.0, [1.0, 1.25]), rec("ep", 2.0, [2.5, 2.0]), rec("collective", 0.01, [0.02, 0.01])]
    b = [rec("pipeline", 3.0, [3.0, 6.0])]
    paths = []
    for i, recs in enumerate((a, b)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(recs), encoding="utf-8")
    assert vs.main(["--pool", *map(str, paths)]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = out["steps"]
    assert steps["runs"] == 3 and steps["samples"] == 6  # the collective is reported apart
    assert steps["median_abs_error"] == pytest.approx(np.median([0, 0.2, 0.2, 0, 0, 0.5]))
    assert out["by_mode"]["collective"]["runs"] == 1 and out["load_average_samples"] == [1.0, 2.0]
    # a file that cannot be read, or is no list of records, is named (it was a traceback)
    (tmp_path / "other.json").write_text('{"rows": []}', encoding="utf-8")
    for path, said in ((tmp_path / "none.json", "cannot read its records"),
                       (tmp_path / "other.json", "not a list of this script's records")):
        with pytest.raises(SystemExit, match=said):
            vs.main(["--pool", str(paths[0]), str(path)])


def test_stage_counter_sums_the_routing_of_every_forward_on_the_stage_layers():
    """The MoE pipeline runs replay counts summed over a step's micro-batches, per global layer index."""
    import types

    import torch

    from moebal.models.moe import MoELayer

    vs = _module()
    cfg = vs._cfg(vs.STEP_CASES[0] | {"model": {"dim": 64, "n_layers": 3, "n_heads": 2, "n_kv_heads": 2,
                                                "ffn_dim": 128},
                                      "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 64}})
    moe = MoELayer(64, 64, 4, 2)
    layers = {1: types.SimpleNamespace(is_moe=False), 2: types.SimpleNamespace(is_moe=True, block_sparse_moe=moe)}
    stage = types.SimpleNamespace(layer_ids=[1, 2], layer=layers.__getitem__)
    counts = vs._stage_counter(stage, cfg)
    seen = np.zeros(4)
    for seed in (0, 1):  # two micro-batches
        moe(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)))
        seen += moe.last_stats.counts_E.numpy()
    assert counts.shape == (3, 4) and seen.sum() == 2 * 8 * 2
    np.testing.assert_array_equal(counts[2], seen)
    assert not counts[:2].any()  # the other layers (dense here, or on the other stage) stay zero
