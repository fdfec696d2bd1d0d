"""The Lina inference benchmark trains its served model, serves it at two widths and reports what it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_lina_inference.py"


def test_quick_run_at_two_widths_reports_each_and_outputs_equal(tmp_path) -> None:
    out = tmp_path / "l.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--train-steps", "8", "--profile-batches", "2",
                           "--width", "256", "128", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["settings"]["width"] == [128, 256] and "train.steps=8" in rep["served_model"]
    assert list(rep["by_width"]) == ["128", "256"]  # narrowest first: each padding continues the last
    for rec in rep["by_width"].values():
        assert rec["padding_max_logit_diff"] < 1e-4
        (summ,) = rec["by_ranks"].values()
        assert all(summ[p]["equal_static"] for p in ("lina", "phase1", "oracle"))
        assert summ["static_over_lina"] > 0 and len(summ["policy_order_per_round"]) == 1
        for p in ("static", "lina"):  # a max over the ranks is at least their mean
            assert summ[p]["experts_s_max_over_mean_layers_1_on"] >= 1.0 and summ[p]["rank_load_max_over_mean"] >= 1.0
        floor = summ["comm_floor"]
        assert floor["per_layer_s"] == floor["counts_s"] + 2 * floor["all_to_all_s"] and floor["all_gather_s"] > 0
        spread = rec["expert_cpu_spread"]
        for pct in [spread["alone"], *spread["2_at_once"]]:  # one rank alone, then both ranks at once
            assert 0 < pct["p10_ms"] <= pct["p50_ms"] <= pct["p90_ms"] and pct["runs"] >= 1
    # each width reports its experts' cost per row at every group size, whole and in blocks (measured: which
    # width costs more is the benchmark's figure, not something a test on a shared machine may time)
    for rec in rep["by_width"].values():
        costs = rec["expert_us_per_row"]
        assert set(costs) == {"whole", "blocks"}
        assert all(list(c) == ["64", "128", "256", "512", "1024"] and min(c.values()) > 0 for c in costs.values())
    # a width below the trained one is refused with the fix
    bad = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--width", "64"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "below the served experts' trained width 128" in bad.stderr
    zero = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rounds", "0"], capture_output=True, text=True,
                          timeout=600)
    assert zero.returncode == 2 and "--rounds takes positive values; got 0" in zero.stderr
