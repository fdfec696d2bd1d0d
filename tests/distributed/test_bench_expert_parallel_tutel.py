"""`scripts/bench_expert_parallel.py`'s Tutel path on 2 gloo ranks with tiny shapes, against a stand-in package
with Tutel's `moe_layer` interface (tests/fake_tutel: Tutel installs from source and is not installed here):
the Tutel method runs beside a moebal policy on the same ranks and routings and produces its records."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from moebal.config import from_dict, to_dict
from moebal.distributed.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "name": "bench-expert-parallel-tiny",
    "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64, "max_seq_len": 16,
              "vocab_size": 256},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "aux_loss_coef": 0.0},
    "data": {"seq_len": 16, "batch_size": 2},
    "train": {"precision": "fp32"},
}


def test_tutel_method_beside_policies(monkeypatch) -> None:
    # spawned ranks start with the parent's sys.path: they import the script and the stand-in from it too
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fake_tutel"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    try:
        bep = importlib.import_module("bench_expert_parallel")
        spec = {"config": to_dict(from_dict(TINY)), "skew": 3.0, "rounds": 2, "steps": 2, "warmup": 1,
                "recorded_shares": None, "tutel": True, "policies": ["static", "fastermoe"]}
        records = run_ranks(bep._worker, 2, spec, timeout_s=120)[0]
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] in ("tutel", "bench_expert_parallel")]:
            del sys.modules[name]
    by = {(r["policy"], r["routing"]): r for r in records}
    assert set(by) == {(m, rt) for m in ("static", "fastermoe", "tutel") for rt in ("balanced", "skewed")}
    for routing in ("balanced", "skewed"):
        tutel = by[("tutel", routing)]
        assert tutel["executor"] == "tutel" and tutel["world_size"] == 2 and tutel["capacity_factor"] == 0.0
        assert tutel["steps"] == 2 * 2 and tutel["step_time_median_s"] > 0  # 2 rounds x 2 timed steps
        assert tutel["tutel"]["version"] == "0.0.0+stand-in"
        assert by[("fastermoe", routing)]["label"] == "fastermoe-policy"
        assert "not FasterMoE's system" in by[("fastermoe", routing)]["note"]
    # the same routing bias reaches Tutel's gate: the skew skews its loads as it does moebal's
    assert by[("tutel", "skewed")]["expert_load_max_over_mean"] > 1.5 > by[("tutel", "balanced")][
        "expert_load_max_over_mean"]
    lines = bep.summarise(records)
    assert "fastermoe-policy" in lines[0] and any("tutel" in line and "skewed" in line for line in lines[1:])


def test_tutel_construction_failure_is_recorded_not_raised(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fake_tutel"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    try:
        bep = importlib.import_module("bench_expert_parallel")
        job, why = bep._tutel_job(from_dict(TINY), rank=0, world=3)  # 4 experts do not divide over 3 ranks
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] in ("tutel", "bench_expert_parallel")]:
            del sys.modules[name]
    assert job is None and why.startswith("construction: ValueError: Tutel holds the same number of experts")
