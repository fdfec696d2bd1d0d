"""scripts/bench_plan_search.py: the bounded search and the DP at every limit, side by side, in its report."""

from __future__ import annotations

import json

from tests.cli_util import load_script


def test_report_sets_the_two_variants_side_by_side(tmp_path):
    script = load_script("bench_plan_search")
    out = tmp_path / "r.json"
    assert script.main(["--sizes", "200", "--repeats", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["samples"] == 200 and row["candidates"] > 128 > row["evaluated"] > 0  # the search skipped most
    assert {k: len(v) for k, v in row["seconds"].items()} == {"search": 2, "every limit": 2}  # every round kept
    assert row["same_plan"] and row["objective_s"]["search"] == row["objective_s"]["every limit"]
    assert script.mb.SEARCH_GRID == 64  # restored after the rounds
