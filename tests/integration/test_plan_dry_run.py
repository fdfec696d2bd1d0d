"""`moebal plan experts --config PRESET --cluster --ranks`: dry-run planning of a real model in one process."""

from __future__ import annotations

import json

from moebal.cli import main


def test_mixtral_dry_run_plans_every_policy(capsys):
    assert main(["plan", "experts", "--config", "mixtral-8x7b", "--cluster", "a100", "--ranks", "8",
                 "--layer", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["layers"][0]
    by = {p["policy"]: p["metrics"] for p in report["plans"]}
    assert set(by) >= {"prophet", "fastermoe", "static"}
    assert report["num_ranks"] == 8 and report["num_experts"] == 8
    assert by["prophet"]["predicted_time_s"] <= by["static"]["predicted_time_s"]
    # the 8 ranks split the global batch (16 sequences of 4,096 tokens, top-2), not each route all of it
    assert report["tokens"] == 16 * 4096 * 2
    assert by["static"]["load_mean"] == 16 * 4096 * 2 / 8


def test_dry_run_rejects_ranks_that_do_not_divide_the_experts(capsys):
    assert main(["plan", "experts", "--config", "mixtral-8x7b", "--ranks", "3"]) == 2
    assert "must divide the 8 experts" in capsys.readouterr().err
    # a layer the dry run does not have is named (it printed nothing and exited 0)
    assert main(["plan", "experts", "--config", "mixtral-8x7b", "--layer", "99"]) == 2
    assert "--layer 99 outside 0..31: the dry run of mixtral-8x7b has 32 MoE layers" in capsys.readouterr().err
