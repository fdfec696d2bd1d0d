"""scripts/bench_plan_microbatches.py: the planner's own time per batch size, with a digest of each plan."""

from __future__ import annotations

import json

from tests.cli_util import load_script


def test_report_times_the_plan_and_the_split(tmp_path):
    script = load_script("bench_plan_microbatches")
    out = tmp_path / "r.json"
    assert script.main(["--sizes", "40,60", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["samples"] for r in rows] == [40, 60]
    for r in rows:
        assert len(r["plan_s"]["all"]) == len(r["split_s"]["cpu_all"]) == 2 and r["plan_s"]["min"] <= r["plan_s"]["max"]
        assert r["micro_batches"] >= 1 and 0 < r["evaluated"] <= r["candidates"] and len(r["plan_digest"]) == 16
    again = tmp_path / "again.json"
    script.main(["--sizes", "40", "--repeats", "1", "--json", str(again)])
    assert json.loads(again.read_text())["rows"][0]["plan_digest"] == rows[0]["plan_digest"]  # plans are replayable
