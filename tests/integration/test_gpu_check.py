"""`scripts/gpu_check.py --device cpu --quick` as CI runs it (a subprocess): every check runs and passes, and the
CUDA-only parts are listed as skipped with their reason, so the script that a GPU machine runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["env", "nccl_smoke", "grouped_gemm", "moe_layer", "train_resume", "expert_kernel_vs_dense", "recompute",
          "memory_plan", "grad_accum", "sparse_attention", "sparse_attention_train", "pipeline_syncs",
          "padded_schemes", "generate"]


def test_gpu_check_quick_on_cpu_runs_every_check_and_lists_the_skipped_parts(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--json", str(out),
                        "--workdir", str(tmp_path / "work")], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["ok"] and report["failed"] == [] and report["device_type"] == "cpu" and report["quick"]
    assert list(report["checks"]) == CHECKS
    for name, res in report["checks"].items():
        assert res["status"] == "passed" and res["ok"], (name, res)
        assert res["wall_s"] >= 0 and res.get("summary"), (name, res)
        assert all(": skipped: " in s for s in res["skipped"]), (name, res["skipped"])
    # what CPU cannot check is said, not silently passed
    skipped = report["skipped"]
    assert any(s.startswith("env: gpu") for s in skipped)
    assert any(s.startswith("nccl_smoke: allreduce_cuda: skipped") for s in skipped)
    assert any(s.startswith("moe_layer: cuda sync debug mode: skipped") for s in skipped)
    assert any(s.startswith("expert_kernel_vs_dense: targets: skipped") for s in skipped)
    checks = report["checks"]
    gen = checks["generate"]  # the KV-cached decoder against the forward: GQA + window, MLA's two caches, MoD
    assert all(gen[k]["vs_forward"]["rel_max"] < 1e-4 for k in ("gqa_window", "mla latent", "mla per-head",
                                                                 "mod_predictor")), gen
    assert gen["mla bf16 latent vs per-head"]["rel_norm"] < 1e-2 and "vs_cpu" not in gen["gqa_window"]
    smoke = checks["nccl_smoke"]
    assert smoke["allreduce_cpu"] and smoke["a2a_fp32"]["ok"] and smoke["a2a_bf16"]["ok"]
    assert smoke["sched_allreduce"] and smoke["grad_sync"]["ok"] and smoke["grad_sync"]["chunks"] > 1
    gg = checks["grouped_gemm"]
    assert 0 in gg["counts"] and gg["empty_experts_zero_grad"]
    assert set(gg["errors"]) == {"y", "dx", "dw1", "dw3", "dw2"}
    moe = checks["moe_layer"]
    assert set(moe["variants"]) == {f"{p}_{k}_{v}" for p, k in (("fp32", "loop"), ("bf16", "grouped_mm"))
                                    for v in ("dropless", "capacity", "adaptive")}
    assert moe["variants"]["fp32_loop_capacity"]["inactive_assignments"] > 0  # drops happened
    assert moe["variants"]["bf16_grouped_mm_adaptive"]["inactive_assignments"] > 0  # some tokens took one expert
    assert isinstance(moe["sync_budget_ok"], bool)
    tr = checks["train_resume"]
    assert tr["resume_bitwise"] and tr["loss_last_quarter"] < tr["loss_first_quarter"] and tr["tokens_per_s"] > 0
    bench = checks["expert_kernel_vs_dense"]
    assert bench["tflops"]["dense"] > 0 and set(bench["x_dense"]) == {"balanced", "skewed_4x"}
    ps = checks["pipeline_syncs"]  # the schedule reads nothing; the step reads the routing and step sums (+ moe's)
    assert ps["syncs"] == {"moe": {"engine": 0, "step": 3}, "sparse_attention": {"engine": 0, "step": 2}}, ps["syncs"]
    pad = checks["padded_schemes"]  # MoD and early exit on padded rows, pruning's radix select: against references
    assert pad["mod"]["same_selection"] and pad["mod"]["syncs"]["audit_syncs"] == 0
    assert pad["early_exit"]["tokens_in_device"][-1] == sum(pad["rows"])  # real tokens entering the network
    assert len(pad["prune_top_k"]) == 8 and all(pad["prune_top_k"].values())
    sa = checks["sparse_attention"]
    assert set(sa["parity"]) == {"0.5", "0.25"}
    assert all(set(p) == {"y", "dq", "dk", "dv"} for p in sa["parity"].values())
    densities = {"0.75", "0.5", "0.25", "0.1"}
    assert densities == set(sa["startup_fit"]["factors"])
    forms = {f"{f}:{d}" for f in ("grouped", "expanded") for d in ("0.5", "0.25")}
    assert set(sa["x_dense"]) == densities | forms | {f"split:{d}" for d in densities}  # the CPU's other path
    assert set(sa["sdpa_backends"]) == {"masked run, grouped", "masked run, expanded", "dense causal, grouped",
                                        "dense [T, T] mask, grouped"}
    assert all(b["MATH"] == "ok" for b in sa["sdpa_backends"].values())  # the math kernel takes every form
    assert any(s.startswith("sparse_attention: full shape: skipped") for s in skipped)
    st = checks["sparse_attention_train"]  # the scheme trained on one stage: dense steps, then the walk
    assert st["runs"]["sparse"]["densities"][0] == [1.0, 1.0] and max(st["runs"]["sparse"]["densities"][-1]) <= 0.5
    assert st["runs"]["sparse"]["losses"] != st["runs"]["dense"]["losses"] and st["sparse_over_dense_step"] > 0
    rc = checks["recompute"]
    assert set(rc["exact_fp32"]) == {"none_again", "none", "moe", "attention", "full"}
    assert all(r["bitwise"] for r in rc["exact_fp32"].values())
    assert {row["mode"] for row in rc["rounds"]} == {"none", "moe", "attention", "full"}
    assert any(s.startswith("recompute: activation peak: skipped") for s in skipped)
    mem = checks["memory_plan"]["layouts"]["tiny_fp32_none"]
    assert mem["predicted"]["peak_bytes"] > mem["predicted"]["runtime_bytes"] > 0 and mem["step_s"] > 0
    assert mem["step_s_predicted_h100"] > 0 and "measured" not in mem  # CUDA allocator figures only
    # the short table is printed too
    assert "expert_kernel_vs_dense" in r.stdout and "memory_plan" in r.stdout and "all passed" in r.stdout


def _load_script(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", mod)  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    gc = _load_script(monkeypatch)

    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setitem(gc.CHECKS, "env", broken)
    out = tmp_path / "r.json"
    code = gc.main(["--device", "cpu", "--quick", "--only", "env,grouped_gemm", "--json", str(out),
                    "--workdir", str(tmp_path / "w")])
    report = json.loads(out.read_text(encoding="utf-8"))
    assert code == 1 and not report["ok"] and report["failed"] == ["env"]
    env = report["checks"]["env"]
    assert env["status"] == "failed" and env["error"] == "RuntimeError: boom" and "broken" in env["traceback"]
    assert report["checks"]["grouped_gemm"]["status"] == "passed"
    assert "FAILED: env" in capsys.readouterr().out
    assert gc.main(["--only", "nope"]) == 2


def _fake_smoke(gc, monkeypatch, launches):
    """`_run_smoke` replaced by a list of (worker result or None, torchrun exit code, stderr), one per launch."""
    import subprocess as sp

    calls = []

    def run(ctx, out):
        res, rc, err = launches[len(calls)]
        calls.append(rc)
        return (None if res is None else dict(res)), sp.CompletedProcess([], rc, "", err)

    monkeypatch.setattr(gc, "_run_smoke", run)
    return calls


GOOD = {"ok": True, "allreduce_cpu": True, "a2a_fp32": {"ok": True}, "a2a_bf16": {"ok": True},
        "sched_allreduce": True, "grad_sync": {"ok": True, "chunks": 13}, "skipped": []}


def test_a_failed_smoke_says_what_failed_and_only_a_launcher_exit_is_run_again(tmp_path, monkeypatch):
    gc = _load_script(monkeypatch)
    ctx = gc.Ctx(torch.device("cpu"), True, float("inf"), tmp_path)
    # a wrong result: never run again, the part is named
    calls = _fake_smoke(gc, monkeypatch, [({**GOOD, "ok": False, "grad_sync": {"ok": False, "chunks": 13}}, 1, "")])
    res = gc.check_nccl_smoke(ctx)
    assert calls == [1] and not res["ok"] and res["error"].startswith("wrong results in: grad_sync")
    # a missing part counts as failed
    res_missing = {k: v for k, v in GOOD.items() if k != "a2a_bf16"}
    calls = _fake_smoke(gc, monkeypatch, [(res_missing, 0, "")])
    res = gc.check_nccl_smoke(ctx)
    assert calls == [0] and not res["ok"] and "a2a_bf16" in res["error"]
    # every part passed but torchrun exited 1: run once more; passing then passes, both exits kept
    calls = _fake_smoke(gc, monkeypatch, [(GOOD, 1, "rendezvous closed"), (GOOD, 0, "")])
    res = gc.check_nccl_smoke(ctx)
    assert calls == [1, 0] and res["ok"] and res["launcher_exits"] == [1, 0]
    assert res["first_launch_stderr_tail"] == "rendezvous closed"
    # ... and failing twice fails, with the launcher's last stderr line
    calls = _fake_smoke(gc, monkeypatch, [(GOOD, 1, "a\nb"), (GOOD, 1, "x\nstore closed")])
    res = gc.check_nccl_smoke(ctx)
    assert calls == [1, 1] and not res["ok"] and res["launcher_exits"] == [1, 1]
    assert "torchrun exited 1 after the worker passed" in res["error"] and "store closed" in res["error"]
    # no result at all
    calls = _fake_smoke(gc, monkeypatch, [(None, 1, "boom")])
    res = gc.check_nccl_smoke(ctx)
    assert calls == [1] and not res["ok"] and "wrote no result (exit 1)" in res["error"]
