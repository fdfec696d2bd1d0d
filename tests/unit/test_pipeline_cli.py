"""`moebal plan stages`: every balancer side by side, JSON output, and clear errors."""

from __future__ import annotations

import json

import pytest

from moebal.cli import main

EARLY_EXIT = ",".join(["1"] * 12 + [str(round(0.9 ** k, 6)) for k in range(1, 13)])


def test_plan_stages_json(capsys, tmp_path):
    assert main(["plan", "stages", "--costs", EARLY_EXIT, "--stages", "4", "--repack", "--slack", "0.3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = {p["balancer"]: p for p in out["plans"]}
    assert plans["uniform"]["sizes"] == [6, 6, 6, 6] and plans["uniform"]["max_load"] == pytest.approx(6.0)
    assert plans["partition"]["max_load"] == pytest.approx(5.0)  # the extraction's worked example
    assert plans["diffusion"]["max_load"] <= 6.0
    assert len(plans["repack"]["sizes"]) < 4
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"meta": {"costs": [1, 1, 1, 4]}}))  # a plans.jsonl record's shape
    assert main(["plan", "stages", "--costs", str(costs), "--stages", "2"]) == 0
    assert "partition" in capsys.readouterr().out


def test_plan_stages_keeps_an_optimal_current_partition(capsys):
    # the README's example: uniform already reaches the optimal maximum, so the partitioner moves nothing
    assert main(["plan", "stages", "--costs", "1,1,1,1,0.5,0.5,0.2,0.2", "--stages", "4", "--json"]) == 0
    plans = {p["balancer"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    assert plans["partition"]["sizes"] == [2, 2, 2, 2] and plans["partition"]["moves_from_current"] == 0
    assert main(["plan", "stages", "--costs", "1,1,1,1,0.5,0.5,0.2,0.2", "--stages", "4", "--from", "1,1,3,3",
                 "--json"]) == 0
    plans = {p["balancer"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    assert plans["partition"]["sizes"] == [1, 1, 2, 4] and plans["partition"]["moves_from_current"] == 1


def test_plan_stages_errors(capsys):
    assert main(["plan", "stages", "--costs", "1,2", "--stages", "3"]) == 2
    assert "at least one layer" in capsys.readouterr().err
    assert main(["plan", "stages", "--costs", "1,2,3", "--stages", "2", "--memory", "5,5,5", "--capacity", "4"]) == 2
    assert "memory caps" in capsys.readouterr().err
    assert main(["plan", "stages", "--costs", "1,x", "--stages", "1"]) == 2
    assert "expected numbers" in capsys.readouterr().err
    assert main(["plan", "stages", "--costs", "1,2", "--stages", "1", "--capacity", "3"]) == 2
    assert "--memory" in capsys.readouterr().err
