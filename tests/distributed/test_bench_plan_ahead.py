"""`scripts/bench_expert_parallel.py`'s plan-ahead method on 2 gloo ranks with tiny shapes: it runs beside static
and prophet, plans layer 1 ahead once its online profile exists, and reports its ratios and prediction accuracy."""

from __future__ import annotations

import importlib
import sys

from moebal.config import from_dict, to_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.test_bench_expert_feedback import ROOT, TINY  # the same tiny model and script path


def test_plan_ahead_runs_beside_static_and_prophet_with_its_accuracy(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # spawned ranks import the script from the same path
    try:
        bep = importlib.import_module("bench_expert_parallel")
        spec = {"config": to_dict(from_dict(TINY)), "skew": 3.0, "rounds": 2, "steps": 2, "warmup": 1,
                "recorded_shares": None, "tutel": False, "policies": ["static", "prophet", bep.AHEAD],
                "path_len": 1, "path_settle": 5, "path_refresh": 5, "path_window": 20}
        records = run_ranks(bep._worker, 2, spec, timeout_s=180)[0]
        lines = bep.summarise(records)
    finally:
        sys.modules.pop("bench_expert_parallel", None)
    by = {(r["policy"], r["routing"]): r for r in records}
    assert set(by) == {(m, rt) for m in ("static", "prophet", "plan-ahead") for rt in ("balanced", "skewed")}
    for routing in ("balanced", "skewed"):
        a = by[("plan-ahead", routing)]
        assert a["steps"] == 4 and len(a["round_medians_s"]) == 2
        assert a["ahead_layers"] == [1] and a["prediction_steps"] == 4
        assert a["median_round_ratio_to_static"] > 0 and a["median_round_ratio_to_prophet"] > 0
        for key in ("path_overlap", "prev_overlap"):
            assert 0.0 <= a["prediction"][key] <= 1.0
        assert a["prediction"]["path_rel_mae"] >= 0 and a["prediction"]["prev_rel_mae"] >= 0
    assert any("plan-ahead (layers [1])" in line for line in lines)
