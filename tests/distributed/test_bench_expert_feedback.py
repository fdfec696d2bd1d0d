"""`scripts/bench_expert_parallel.py`'s closed-loop method (`prophet+feedback`) on 2 gloo ranks with tiny shapes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from moebal.config import from_dict, to_dict
from moebal.distributed.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
    "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "aux_loss_coef": 0.0},
    "data": {"seq_len": 16, "batch_size": 2},
    "train": {"precision": "fp32"},
}


def test_the_closed_loop_runs_beside_static_with_its_rounds_and_verdicts(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # spawned ranks import the script from the same path
    try:
        bep = importlib.import_module("bench_expert_parallel")
        spec = {"config": to_dict(from_dict(TINY)), "skew": 3.0, "rounds": 2, "steps": 2, "warmup": 1,
                "settle": 9, "recorded_shares": None, "tutel": False, "policies": ["static", bep.FEEDBACK]}
        records = run_ranks(bep._worker, 2, spec, timeout_s=120)[0]
        lines = bep.summarise(records)
    finally:
        sys.modules.pop("bench_expert_parallel", None)
    by = {(r["policy"], r["routing"]): r for r in records}
    assert set(by) == {(m, rt) for m in ("static", "prophet+feedback") for rt in ("balanced", "skewed")}
    for routing in ("balanced", "skewed"):
        loop = by[("prophet+feedback", routing)]
        assert loop["steps"] == 2 * 2 and len(loop["round_medians_s"]) == 2 and 0.0 <= loop["plan_arm_share"] <= 1.0
        # the settle-in steps are the loop's first trial (warm-up, 4 base steps, 4 plan steps): one verdict
        assert [d["verdict"] in ("kept", "backed_off") for d in loop["feedback_decisions"]] == [True]
        assert len(by[("static", routing)]["round_medians_s"]) == 2 and loop["median_round_ratio_to_static"] > 0
    assert any("round 2 ratio to static: prophet+feedback" in line for line in lines)
