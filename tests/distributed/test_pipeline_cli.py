"""`moebal train --nproc 4 --pp 4` end to end: rebalancing, a dynamism scheme and re-packing with released ranks.

Each job runs in the test process (tests/cli_util.py): the launcher forks its ranks from the test process's
forkserver, as `moebal train --nproc N` does from its own."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import run_cli


@pytest.mark.slow
def test_train_pipeline_rebalances_and_releases_ranks(tmp_path):
    out = tmp_path / "run"
    cmd = ["train", "--nproc", "4", "--pp", "4", "--steps", "6",
           "--rebalance", "partition", "--dynamism", "early_exit", "--out", str(out),
           "model.dim=32", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
           "moe.num_experts=0", "data.seq_len=16", "data.batch_size=4", "data.max_bytes=200000",
           "pipeline.every=2", "pipeline.repack=true", "pipeline.repack_slack=100",
           "dynamism.early_exit.threshold=0.9", "dynamism.early_exit.first_layer=2"]
    proc = run_cli(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 released at step 2" in proc.stderr and "rank 2 released at step 2" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["released_ranks"] == [1, 2] and summary["stages"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["stages"] == 2 and sum(records[-1]["sizes"]) == 8
    assert all(k in records[-1] for k in ("stage_busy_s", "bubble_ratio", "survival", "tokens_per_s"))
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert any(p["balancer"] == "repack" and p["released"] == [1, 2] for p in plans)
    assert (out / "pipeline.svg").stat().st_size > 0 and (out / "dashboard.svg").stat().st_size > 0


@pytest.mark.slow
def test_train_pipeline_with_expert_parallel_stages(tmp_path):
    out = tmp_path / "run"
    cmd = ["train", "--nproc", "4", "--pp", "2", "--ep", "2", "--steps", "4",
           "--rebalance", "partition", "--dynamism", "moe", "--out", str(out), "--json",
           "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
           "moe.num_experts=4", "moe.expert_ffn_dim=32", "data.seq_len=16", "data.batch_size=8",
           "data.max_bytes=200000", "pipeline.every=2", "planner.policy=broadcast_topk", "planner.costs=rtx3090"]
    proc = run_cli(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2-stage pipeline x 1 data-parallel x 2 expert-parallel" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["stages"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["replicas"]) == 4 and len(r["rank_imbalance_after"]) == 4 for r in records)
    assert all(len(r["predicted_cost"]) == 4 for r in records)
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    assert [p["step"] for p in plans] == [2, 3, 4]  # the routing cost is re-planned after every step


@pytest.mark.slow
def test_train_pipeline_with_dynamic_micro_batching(tmp_path):
    out = tmp_path / "run"
    cmd = ["train", "--nproc", "4", "--pp", "4", "--steps", "5",
           "--microbatching", "dynamic", "--out", str(out),
           "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
           "model.max_seq_len=128", "moe.num_experts=0", "data.seq_len=128", "data.batch_size=16",
           "data.max_bytes=300000", "data.samples=documents", "data.units=blocks", "train.precision=fp32",
           "pipeline.dynamic.max_tokens=512", "pipeline.dynamic.lookahead=2"]
    proc = run_cli(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamic micro-batching" in proc.stderr and "padding efficiency" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["microbatching"] == "dynamic"
    assert summary["padding_efficiency"] > 0.5 and sum(summary["schedules"].values()) == 5
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 6))
    assert all(r["micro_batches"] >= 1 and r["plan_wait_s"] >= 0 and r["loss"] > 0 for r in records)


def _planned_ep_job(out, steps: int, *extra: str) -> list[dict]:
    """`moebal train` of 2 stages x 2 expert shards with micro-batches planned on the a100 table under a 1e6-byte
    activation budget, which splits each step into 8, and Pro-Prophet's placements planned on it too (tables
    measured at start-up differ between two runs, and so would the plans and replicas, and the order the losses
    and gradients sum in); the run's metrics records."""
    cmd = ["train", "--nproc", "4", "--pp", "2", "--ep", "2", "--steps",
           str(steps), "--microbatching", "dynamic", "--out", str(out), *extra,
           "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
           "model.max_seq_len=128", "moe.num_experts=4", "moe.expert_ffn_dim=32", "data.seq_len=128",
           "data.batch_size=16", "data.max_bytes=300000", "data.samples=documents", "data.units=blocks",
           "train.precision=fp32", "train.ckpt_every=2", "train.eval_every=2", "pipeline.dynamic.max_tokens=512",
           "pipeline.dynamic.lookahead=2", "pipeline.dynamic.costs=a100", "pipeline.dynamic.memory=1e6",
           "planner.costs=a100"]
    proc = run_cli(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2-stage pipeline x 1 data-parallel x 2 expert-parallel, dynamic micro-batching" in proc.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_planned_micro_batches_on_expert_parallel_stages_resume(tmp_path):
    """Lockstep plans from the command line, with validation and checkpoints; a resumed run plans and trains
    its own steps from the checkpoint's data position, with the uninterrupted run's losses."""
    whole = _planned_ep_job(tmp_path / "whole", 4)
    _planned_ep_job(tmp_path / "cut", 2)
    resumed = _planned_ep_job(tmp_path / "cut", 4, "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and all(r["micro_batches"] >= 2 for r in resumed)
    assert [r["micro_batches"] for r in resumed] == [r["micro_batches"] for r in whole]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


@pytest.mark.slow
def test_train_pipeline_zero_bubble_from_the_command_line_matches_1f1b(tmp_path):
    losses, w_cpu = {}, {}
    for sched in ("1f1b", "zb"):
        out = tmp_path / sched
        cmd = ["train", "--nproc", "2", "--pp", "2", "--steps", "3",
               "--rebalance", "partition", "--out", str(out), f"pipeline.schedule={sched}",
               "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
               "moe.num_experts=0", "data.seq_len=16", "data.batch_size=4", "data.max_bytes=200000",
               "pipeline.every=1", "train.precision=fp32"]
        proc = run_cli(*cmd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[sched] = [r["loss"] for r in records]
        w_cpu[sched] = [sum(r["stage_w_cpu_s"]) for r in records]
    assert losses["zb"] == losses["1f1b"] and len(losses["zb"]) == 3
    assert all(w > 0 for w in w_cpu["zb"]) and all(w == 0 for w in w_cpu["1f1b"])
