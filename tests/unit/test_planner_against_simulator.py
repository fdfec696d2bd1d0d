"""scripts/planner_against_simulator.py: the planner's and the simulator's all-to-all agree, uniform and skewed,
on one NIC per GPU (h100) and one per node (a100, 8 ranks on 2 nodes), and the planner picks the replication
prefix the simulator finds fastest (Trans and Agg as moebal's executor sends them)."""

from __future__ import annotations

import json

from tests.cli_util import load_script


def test_the_comparison_runs_and_agrees_where_the_docs_say(tmp_path, capsys) -> None:
    script = load_script("planner_against_simulator")
    out = tmp_path / "r.json"
    assert script.main(["--profiles", "h100,a100", "--ranks", "8", "--zipf", "1.0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for profile in ("h100", "a100"):
        a = report[profile]["all_to_all"]
        for kind in ("uniform", "skewed"):  # a skewed exchange loads a shared NIC with the hot rank's bytes only
            assert abs(a[f"{kind}_planner_ms"] - a[f"{kind}_simulator_ms"]) < 1e-9 * a[f"{kind}_simulator_ms"]
    for profile in ("h100", "a100"):  # the planner's choice is the simulator's fastest prefix
        [z] = report[profile]["prefixes"]
        assert len(z["prefix_ms"]) >= 2 and z["planner_choice"] == z["simulator_fastest"] and not z["inverted"]
    assert "planner picks prefix" in capsys.readouterr().out
