"""`moebal simulate` end to end (in-process: the CLI's own main)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moebal.cli import main
from moebal.sim.routing import write_routing_log


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_mixtral_json_and_trace(capsys, tmp_path) -> None:
    trace = tmp_path / "trace.json"
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--cluster", "h100-ndr400", "--ranks", "16", "--json",
                         "--trace", str(trace)])
    assert out["iteration_time_s"] > 0 and out["meta"]["ep"] == 8 and out["meta"]["dp"] == 16
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(16))


@pytest.mark.parametrize("policy", ["static", "fastermoe", "prophet"])
def test_policies_run_on_llama_moe(capsys, policy: str) -> None:
    out = _json(capsys, ["simulate", "llama-moe-3.5b", "--cluster", "a100", "--ranks", "8", "--policy", policy,
                         "--seq-len", "1024", "--zipf", "1.2", "--json"])
    assert out["policy"] == policy and out["iteration_time_s"] > 0
    if policy == "static":
        assert out["placements"]["replicas"] == 0


def test_pipeline_and_lina_options(capsys) -> None:
    out = _json(capsys, ["simulate", "mixtral-8x7b", "--cluster", "h100", "--ranks", "32", "--pp", "4", "--lina",
                         "--schedule", "gpipe", "--seq-len", "1024", "--json"])
    assert out["meta"]["micro_batches"] == 16 and out["meta"]["stage_layers"] == [8, 8, 8, 8]
    assert 0 < out["bubble_ratio"] < 1


def test_replayed_routing_log(capsys, tmp_path) -> None:
    rng = np.random.default_rng(0)
    log = tmp_path / "routing.jsonl"
    write_routing_log(log, [rng.integers(0, 100, size=(4, 2, 8)).astype(float) for _ in range(3)])
    out = _json(capsys, ["simulate", "--cluster", "a100", "--ranks", "8", "--ep", "8", "--routing", str(log),
                         "--policy", "prophet", "--json"])
    assert out["iteration_time_s"] > 0


def test_human_output(capsys) -> None:
    assert main(["simulate", "--cluster", "rtx3090", "--ranks", "4", "--ep", "4"]) == 0
    text = capsys.readouterr().out
    assert "iteration time" in text and "bubble ratio" in text


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "h10"], "did you mean 'h100'"),
    (["--ranks", "12", "--ep", "8"], "must divide the data-parallel size"),
    (["moe.top_kk=1"], "did you mean 'moe.top_k'"),
    (["--routing", "/nonexistent/routing.jsonl"], "cannot read it"),
])
def test_bad_input_is_a_clear_error(capsys, argv: list[str], message: str) -> None:
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err
