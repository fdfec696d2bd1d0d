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
    # one file with both lists: --costs reads its costs, --memory its memory (not the costs again)
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"costs": [1, 1, 1, 1], "memory": [100, 100, 100, 900]}))
    assert main(["plan", "stages", "--costs", str(both), "--memory", str(both), "--capacity", "500",
                 "--stages", "2"]) == 2
    assert "memory caps" in capsys.readouterr().err
    assert main(["plan", "stages", "--costs", str(both), "--memory", str(both), "--capacity", "1000",
                 "--stages", "2", "--from", str(costs)]) == 2  # the record holds no 'from'
    assert "--from " in (err := capsys.readouterr().err) and "an object with 'from'" in err


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
    # a --from that is not a partition of the layers over the stages (it was planned from as given)
    assert main(["plan", "stages", "--costs", "1,2,3", "--stages", "2", "--from", "3"]) == 2
    assert "give 2 layer counts" in capsys.readouterr().err
    for flag, value in (("--micro-batches", "0"), ("--slack", "-0.1"), ("--first-extra", "-1"), ("--comm", "nan")):
        assert main(["plan", "stages", "--costs", "1,2", "--stages", "2", flag, value]) == 2
        assert f"{flag} must be at least" in capsys.readouterr().err
    # no stages at all, with a --from: the count is what is wrong, not the partition
    assert main(["plan", "stages", "--costs", "1,2", "--stages", "0", "--from", "1,1"]) == 2
    assert "--stages must be at least 1; got 0" in capsys.readouterr().err


def test_plan_stages_takes_long_lists_and_layers_without_cost(capsys):
    costs = ",".join(["1.25"] * 300)  # longer than a file name may be: it was taken for a path and failed
    assert main(["plan", "stages", "--costs", costs, "--stages", "4", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans[0]["sizes"] == [75, 75, 75, 75]
    assert main(["plan", "stages", "--costs", "0,0,0", "--stages", "3"]) == 0  # no work: no speed-up to print
    assert "-" in capsys.readouterr().out


def test_a_closed_stdout_ends_the_command_quietly(monkeypatch):
    # `moebal plan ... | head`: the reader left before the output was written; no traceback, the shell's 141
    import signal
    import sys

    class Gone:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert main(["plan", "stages", "--costs", "1,2,3,4", "--stages", "2", "--json"]) == 128 + signal.SIGPIPE


def test_a_full_disk_under_a_command_without_resume_says_to_run_it_again(capsys, monkeypatch):
    """The disk-full line offers --resume only to the commands that have it (train, launch)."""
    import errno
    import os

    import moebal.commands.plan_stages as plan_stages

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out.json")

    monkeypatch.setattr(plan_stages, "run_stages", full)
    assert main(["plan", "stages", "--costs", "1,2", "--stages", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("moebal plan: error: No space left on device: /data/out.json; free "
                                               "space and run it again")
