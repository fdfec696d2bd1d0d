"""The expert-parallel hook's per-step files follow `train.log_every` like metrics lines: plans.jsonl (every MoE
layer's per-rank counts and placements) and comm/rankN.jsonl (the step's collectives) get the logged steps, the
last one, and (plans.jsonl) any step with a feedback verdict. 2 gloo ranks, a tiny fp32 MoE model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import shard_cfg, train_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(rank: int, world: int, root: str) -> None:
    train_run(shard_cfg("none", 2, "prophet", steps=7, log_every=3), Path(root))


def test_plans_and_communication_logs_follow_log_every(tmp_path):
    run_ranks(_run, 2, str(tmp_path), timeout_s=300)

    def steps(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    metrics = [r["step"] for r in steps(tmp_path / "metrics.jsonl") if "loss" in r]
    plans = steps(tmp_path / "plans.jsonl")
    assert metrics == [3, 6, 7]
    assert {3, 6, 7} <= {p["step"] for p in plans} and all(p["step"] in (3, 6, 7) or p["feedback"] for p in plans)
    for rank in range(2):
        assert [e["step"] for e in steps(tmp_path / "comm" / f"rank{rank}.jsonl")] == [3, 6, 7]
