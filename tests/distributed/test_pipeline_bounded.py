"""A pipeline run does not grow with its steps: the stage's expert-parallel communication log holds one step's
events, the runner keeps no step records through a trainer's run (the summary keeps sums) and ranks other than
0 keep no layer plans (rank 0 writes them out as they come). 2 gloo ranks, tiny fp32 MoE models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks
from moebal.train.hooks import Hook

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(pp: int, ep: int, **pipeline: Any) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"seq_len": 16, "batch_size": 4, "max_bytes": 200_000},
        "train": {"steps": 8, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32", "threads": 1,
                  "ckpt_every": 0, "progress": "plain"},
        "parallel": {"pp": pp, "nproc": 2, "ep": ep}, "planner": {"costs": "a100", "policy": "prophet"},
        "dynamism": {"scheme": "moe"}, "pipeline": {"micro_batches": 2, **pipeline}})


class _Sizes(Hook):
    """After each step: the stage's logged communication events, the runner's records and plans held."""

    name = "sizes"

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def after_step(self, trainer: Any, step: int, stats: Any, record: dict[str, Any]) -> None:
        runner = trainer.strategy.runner
        ep = runner.experts.ep
        events = 0 if ep is None else len(ep.sched.log.events) + len(ep.sched.log.spans)
        self.rows.append((events, len(runner.records), len(runner.plans)))


def _run(rank: int, world: int, tmp: str, pp: int, ep: int, pipeline: dict[str, Any], force: tuple = ()
         ) -> dict[str, Any]:
    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    dims = ParallelDims(world_size=world, rank=rank, pp=pp, ep=ep).init()
    sizes = _Sizes()
    trainer = pipeline_trainer(_cfg(pp, ep, **pipeline), Path(tmp), dims=dims, hooks=[sizes], force=force)
    try:
        trainer.train()
        summary = trainer.strategy.summary(trainer)
    finally:
        trainer.close()
        dims.close()
    return {"rows": sizes.rows, "summary": summary}


def test_a_stage_s_expert_parallel_log_holds_one_step(tmp_path):
    out = run_ranks(_run, 2, str(tmp_path), 1, 2, {}, timeout_s=300)
    for r in out:
        events = [e for e, _, _ in r["rows"]]
        # one step's events (they vary with the step's replicas), not the run's sum (8 steps: 8 times as many)
        assert events[0] > 0 and max(events) < 1.5 * max(events[:2]), events
        assert all(n == 0 for _, n, _ in r["rows"])  # no step record kept


def test_pipeline_records_and_plans_do_not_add_up_and_the_summary_counts_them(tmp_path):
    # the layer balancer plans every step under the moe scheme; rank 0 writes each plan to plans.jsonl; forced
    # partitions after steps 2 and 5 make two migrations (besides any the planner makes)
    out = run_ranks(_run, 2, str(tmp_path), 2, 1, {"rebalance": "partition", "every": 1},
                    ((2, (1, 3)), (5, (3, 1))), timeout_s=300)
    for rank, r in enumerate(out):
        assert all(n == 0 for _, n, _ in r["rows"]), r["rows"]
        if rank:
            assert all(p == 0 for _, _, p in r["rows"]), r["rows"]
    written = (tmp_path / "plans.jsonl").read_text().splitlines()
    assert len(written) >= 4 and all(json.loads(line) for line in written)
    # the summary's sums against the steps' records as metrics.jsonl holds them
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    moves = [x for x in lines if x.get("migration")]
    summary = out[0]["summary"]
    assert len(lines) == 8 and len(moves) >= 2 and summary["migrations"] == len(moves)
    assert summary["layers_moved"] == sum(x["layers_moved"] for x in moves)
    assert summary["bubble_ratio_last"] == lines[-1]["bubble_ratio"] and summary["stages"] == 2
