"""`moebal train --nproc N` end to end: the same losses as one process, plans written, resume exact.

Jobs run in the test process (tests/cli_util.py), launcher included; a killed rank's job is a process of its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_util import Ran, run_cli

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
        "moe.num_experts=4", "moe.expert_ffn_dim=64", "data.seq_len=64", "data.batch_size=4",
        "data.max_bytes=400000", "train.precision=fp32", "train.eval_every=4", "train.eval_batches=2",
        "train.warmup_steps=2", "train.ckpt_every=4", "train.threads=1", "planner.costs=a100"]
"""`planner.costs=a100`: the planner prices with a hardware profile, not with this machine's live timing, so the
placements (and whether the two-rank run replicates, which its parity with one process must cover) are the same
on every run."""


def _train(out: Path, *extra: str) -> Ran:
    """`moebal train` in this process (tests/cli_util.py); its `--nproc N` ranks are forked as a user's are."""
    return run_cli("train", "--steps", "8", "--seed", "0", "--out", str(out), *TINY, *extra)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[Path, Ran]:
    """One `_train(..., "--nproc", "2")` job the tests below only read (each copies what it changes)."""
    out = tmp_path_factory.mktemp("two_rank_run") / "run"
    return out, _train(out, "--nproc", "2")


@pytest.mark.slow
def test_two_ranks_match_one_process_and_write_plans(tmp_path, two_rank_run):
    (tmp_path / "two").symlink_to(two_rank_run[0])
    one, two = _train(tmp_path / "one", "--nproc", "1"), two_rank_run[1]
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["step"], x["loss"], y["loss"])
        if "val_loss" in x:
            assert abs(x["val_loss"] - y["val_loss"]) <= 1e-5 * x["val_loss"]
    plans = [json.loads(line) for line in (tmp_path / "two" / "plans.jsonl").read_text().splitlines()]
    assert len(plans) == 8 and len(plans[0]["counts"]) == 2  # one R x E matrix per MoE layer
    # Pro-Prophet replicated (Trans and Agg ran), so the parity above covers replicas' gradients summed back
    assert sum(len(r) for p in plans for u in p["used"] for r in u["replicas"]) > 0
    assert "rank_imbalance_after" in b[-1] and "expert placement" in two.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["placement"]["policy"] == "prophet"


@pytest.mark.slow
def test_two_rank_resume_is_exact(tmp_path, two_rank_run):
    (tmp_path / "full").symlink_to(two_rank_run[0])
    full = two_rank_run[1]
    assert full.returncode == 0, full.stderr[-2000:]
    # an interrupted run: the full run as it stood after its step-4 checkpoint (one shard file per rank)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "ckpt-0000008")
    assert (part / "ckpt-0000004" / "model-r00001.safetensors").is_file()
    resumed = run_cli("train", "--out", str(part), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = _metrics(tmp_path / "full"), _metrics(part)
    assert [x["step"] for x in b] == list(range(1, 9))
    assert [x["loss"] for x in a] == [y["loss"] for y in b]
    assert [x.get("val_loss") for x in a] == [y.get("val_loss") for y in b]
    # the same plans, predicted times included: the resumed run plans from the coefficients the full run
    # measured (saved in the checkpoint), not from a new measurement that would differ and move replicas
    full_plans = (tmp_path / "full" / "plans.jsonl").read_text().splitlines()
    assert (part / "plans.jsonl").read_text().splitlines() == full_plans
    # --resume-from the run's older checkpoint: the launcher sets the newer one aside before any rank starts (a
    # restart of ranks that died before rank 0 moved it would have continued it), and the losses are the same
    again = run_cli("train", "--out", str(part), "--resume-from", str(part / "ckpt-0000004"), "--nproc", "2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "its 1 newer checkpoint moved to" in again.stderr
    assert [p.name for p in (part / "superseded" / "1").iterdir()] == ["ckpt-0000008"]
    assert [x["loss"] for x in _metrics(part)] == [x["loss"] for x in a]


# 1,024 rows per rank and layer in bf16: sizes at which the former per-size timing of the expert kernels chose
# between loop and grouped_mm in every process (and made two runs of one seed differ from step 2 on). The
# planner's coefficients come from a profile: measured ones differ run to run, and so do the placements they
# choose (replicas change summation order), which fresh runs of `planner.costs: measure` may show.
TIMED_SIZES = ["data.batch_size=16", "moe.expert_ffn_dim=128", "train.precision=bf16", "moe.kernel=auto",
               "planner.costs=a100"]


@pytest.mark.slow
def test_kernel_auto_gives_one_seed_the_same_losses_in_fresh_runs_and_on_resume(tmp_path):
    a, b = (_train(tmp_path / n, "--nproc", "2", *TIMED_SIZES) for n in ("a", "b"))
    assert a.returncode == 0, a.stderr[-2000:]
    assert b.returncode == 0, b.stderr[-2000:]
    assert [x["loss"] for x in _metrics(tmp_path / "a")] == [y["loss"] for y in _metrics(tmp_path / "b")]
    record = json.loads((tmp_path / "a" / "kernels.json").read_text())["experts"]
    assert (record["kernel"], record["source"], record["dtype"]) == ("loop", "auto", "bfloat16")
    part = tmp_path / "part"  # interrupted after its step-4 checkpoint, then resumed
    shutil.copytree(tmp_path / "a", part)
    shutil.rmtree(part / "ckpt-0000008")
    resumed = run_cli("train", "--out", str(part), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [x["loss"] for x in _metrics(tmp_path / "a")] == [y["loss"] for y in _metrics(part)]
    assert json.loads((part / "kernels.json").read_text())["experts"]["source"] == "checkpoint"


def test_rank_failure_stops_the_job_with_a_clear_error(tmp_path):
    # a batch that two ranks cannot split evenly is refused by the launcher, before any rank starts
    bad = _train(tmp_path / "bad", "--nproc", "2", "data.batch_size=3")
    assert bad.returncode == 2
    assert "divisible by the 2 ranks" in bad.stderr and "failed" not in bad.stderr, bad.stderr
    # so is a stage layout its runner would refuse (a stage's 2 expert shards cannot split 3 experts)
    layout = _train(tmp_path / "layout", "--nproc", "4", "--pp", "2", "moe.num_experts=3")
    assert layout.returncode == 2
    assert "parallel.ep = 2 needs MoE layers whose moe.num_experts (3)" in layout.stderr, layout.stderr
    assert "failed" not in layout.stderr
    # and ranks that do not split into ep x pp, named as such (not as a batch the wrong split cannot divide)
    splits = (("ep3", ("--nproc", "3", "--ep", "2"), "world size 3 is not divisible by ep (2)"),
              ("pp3", ("--nproc", "2", "--pp", "3", "model.n_layers=3"), "world size 2 is not divisible by ep (1)"))
    for name, extra, said in splits:
        split = _train(tmp_path / name, *extra)
        assert split.returncode == 2 and said in split.stderr and "failed" not in split.stderr, split.stderr
    # what only a rank finds (a corrupt checkpoint shard, read when it loads) fails on the ranks: the launcher
    # reports the rank and stops the others
    run = tmp_path / "run"
    assert _train(run, "--nproc", "2", "train.ckpt_every=4").returncode == 0
    shard = next((run / "ckpt-0000008").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))
    late = run_cli("train", "--steps", "10", "--out", str(run), "--resume", "--nproc", "2")
    assert late.returncode == 2
    assert "is corrupt" in late.stderr and "failed (exit code 2); stopped the other ranks" in late.stderr, late.stderr
    # a --resume-from that names no checkpoint is the launcher's to refuse, before any rank starts
    gone = run_cli("train", "--steps", "10", "--out", str(run), "--resume-from", str(run / "ckpt-0000003"),
                   "--nproc", "2")
    assert gone.returncode == 2 and "is not a checkpoint directory" in gone.stderr, gone.stderr
    assert "failed" not in gone.stderr, gone.stderr


def test_divergence_stops_every_rank_at_the_same_step(tmp_path):
    # the reduced loss and gradient norm are the same on both ranks: both stop at the first non-finite step (no
    # rank waits in a collective for the other), the job exits 2 without a restart, and no checkpoint is written
    out = tmp_path / "div"
    r = run_cli("train", "--steps", "30", "--seed", "0", "--out", str(out), *TINY, "--nproc", "2", "train.lr=1000",
                "train.grad_clip=0", "train.warmup_steps=0", "train.ckpt_every=0", "--max-restarts", "1")
    assert r.returncode == 2, r.stderr
    assert "training diverged" in r.stderr and "restarting" not in r.stderr, r.stderr
    last = _metrics(out)[-1]
    assert f"step {last['step']}:" in r.stderr and last["step"] < 30, r.stderr
    assert not list(out.glob("ckpt-*"))


def _children(pid: int) -> list[int]:
    """The ranks of launcher `pid` in rank order: forked ones (named moebal-rankN) are children of its forkserver,
    fresh ones (MOEBAL_RANK_START=exec) its own children."""
    def kids(p: int) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def name(p: int) -> str:
        try:
            return Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            return ""

    forked = [g for c in kids(pid) for g in [c, *kids(c)] if name(g).startswith("moebal-rank")]
    return sorted(forked, key=name) if forked else kids(pid)


@pytest.mark.slow
def test_a_rank_killed_mid_run_stops_the_others(tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "moebal.cli", "train", "--steps", "10000", "--seed", "0", "--out", str(out),
           "--nproc", "2", *TINY]
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0):
            assert parent.poll() is None and time.monotonic() < deadline, "the run never started training"
            time.sleep(0.2)
        ranks = _children(parent.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        _, err = parent.communicate(timeout=60)  # fails fast: no waiting in a collective for the dead rank
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode != 0
    assert "rank 1 failed (signal 9)" in err
    assert not _children(parent.pid)


def test_complexity_order_on_two_ranks_matches_one_process(tmp_path):
    """Adaptive Gating's curriculum (data.order complexity) on 2 expert-parallel ranks: each rank records its own
    rows, the table is gathered, so both ranks order the second epoch alike and as one process does (the same
    losses within 1e-5, the same table in the checkpoints)."""
    extra = ["moe.adaptive_threshold=0.02", "data.order=complexity", "data.max_bytes=1500", "data.val_fraction=0",
             "train.eval_every=0", "train.ckpt_every=8"]
    one, two = _train(tmp_path / "one", "--nproc", "1", *extra), _train(tmp_path / "two", "--nproc", "2", *extra)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["step"], x["loss"], y["loss"])
    states = [json.loads((tmp_path / run / "ckpt-0000008" / "state.json").read_text()) for run in ("one", "two")]
    data = [s["data"] for s in states]
    assert data[0]["epoch"] >= 1 and data[0] == data[1]  # past the first epoch; one table, equal
    assert len(data[0]["curriculum"]["entries"]) >= 16


def test_complexity_order_in_a_pipeline_matches_one_process(tmp_path):
    """The curriculum in a 2-stage pipeline, alone and with two data-parallel copies of each stage (each rank
    measures its rows in its stage's MoE layer after each forward; the table is summed over the stage's ranks and
    along the chain): the same table in the checkpoint as one process over the same two micro-batches
    (`train.grad_accum=2`), past the first epoch, and the same losses within 1e-5."""
    extra = ["moe.adaptive_threshold=0.02", "data.order=complexity", "data.max_bytes=1500", "data.val_fraction=0",
             "train.eval_every=0", "train.ckpt_every=8"]
    runs = {"one": ("--nproc", "1", "train.grad_accum=2"),
            "pp2": ("--nproc", "2", "--pp", "2", "pipeline.micro_batches=2"),
            "pp2_dp2": ("--nproc", "4", "--pp", "2", "parallel.ep=1", "pipeline.micro_batches=2")}
    for name, layout in runs.items():
        ran = _train(tmp_path / name, *layout, *extra)
        assert ran.returncode == 0, (name, ran.stderr[-2000:])
    ref = _metrics(tmp_path / "one")
    data = {name: json.loads((tmp_path / name / "ckpt-0000008" / "state.json").read_text())["data"] for name in runs}
    assert data["one"]["epoch"] >= 1 and len(data["one"]["curriculum"]["entries"]) >= 16  # past the first epoch
    for name in ("pp2", "pp2_dp2"):
        got = _metrics(tmp_path / name)
        assert len(got) == len(ref) == 8
        for x, y in zip(ref, got):
            assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (name, x["step"], x["loss"], y["loss"])
        assert data[name] == data["one"], name  # one table, equal: the next epoch's order follows from it


def test_complexity_order_on_planned_micro_batches_records_the_samples_and_resumes_exactly(tmp_path):
    """The curriculum on a 2-stage pipeline with planned micro-batches: through the first epoch the same losses
    (1e-5) and the same table entries as one process on the same batches (no load-balancing loss: a plan groups
    the samples into micro-batches of its own, and that loss is not linear in them); the planner draws batches 2 steps
    ahead, so the second epoch is ordered without the last 3 batches' entries (`curriculum_lag`), which makes the
    order independent of when it was taken: a run resumed from its step-4 checkpoint (taken after the uninterrupted
    run ordered the next epoch, before its resume reads it again) trains the uninterrupted run's losses."""
    extra = ["moe.adaptive_threshold=0.02", "moe.aux_loss_coef=0", "data.order=complexity", "data.max_bytes=1500",
             "data.val_fraction=0", "train.eval_every=0", "train.ckpt_every=4", "train.keep_checkpoints=4"]
    planned = ("--nproc", "2", "--pp", "2", "pipeline.microbatching=dynamic", "pipeline.dynamic.costs=a100")
    for name, layout in (("one", ("--nproc", "1", "train.grad_accum=2")), ("planned", planned)):
        ran = _train(tmp_path / name, *layout, *extra)
        assert ran.returncode == 0, (name, ran.stderr[-2000:])
    ref, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "planned")
    state = json.loads((tmp_path / "planned" / "ckpt-0000008" / "state.json").read_text())["data"]
    assert state["epoch"] >= 1  # past the first epoch
    first = state["samples"] // 4  # the steps whose batches lie inside the first epoch
    for x, y in zip(ref[:first], got[:first], strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["step"], x["loss"], y["loss"])
    one = json.loads((tmp_path / "one" / "ckpt-0000004" / "state.json").read_text())["data"]["curriculum"]["entries"]
    mine = json.loads((tmp_path / "planned" / "ckpt-0000004" / "state.json").read_text())["data"]["curriculum"]
    assert len(mine["entries"]) == len(one) == 16  # 4 steps x 4 samples: the same samples, positions and tokens
    assert [(e[0], e[1], e[3]) for e in mine["entries"]] == [(e[0], e[1], e[3]) for e in one]
    # the shares of two-expert tokens: the plan's micro-batch shapes sum in another order than one process's, so a
    # token near adaptive gating's threshold may take the other count (1/64 of a 64-token sample)
    assert all(abs(a - b) <= 2 / 64 for x, y in zip(mine["entries"], one) for a, b in zip(x[2], y[2]))
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "planned", part)
    shutil.rmtree(part / "ckpt-0000008")
    resumed = run_cli("train", "--out", str(part), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["loss"] for r in _metrics(part)] == [r["loss"] for r in got]
    assert json.loads((part / "ckpt-0000008" / "state.json").read_text())["data"] == state


@pytest.mark.parametrize("layout", [("--nproc", "2"), ("--nproc", "4", "--pp", "2"),
                                    ("--nproc", "4", "--pp", "2", "--microbatching", "dynamic",
                                     "pipeline.dynamic.costs=a100")],
                         ids=["dp", "pp2", "pp2-planned"])
def test_lina_expert_packing_chooses_a_layout_records_it_and_keeps_it_on_resume(tmp_path, layout):
    """scheduler.expert_packing lina (from the a100 profile: deterministic) picks the expert-parallel size before
    sharding (in a pipeline: of each stage's 2 ranks; with planned micro-batches, whose lockstep ranks follow it),
    writes packing.json, trains exactly as a run with that size set by hand, and a resume keeps it. The planned
    layout plans on the a100 table too: a table measured at start-up differs between the two runs, and so may
    their micro-batch counts, and with them the order the losses sum in."""
    extra = ["moe.num_experts=4", "scheduler.expert_packing=lina", "planner.costs=a100"]
    packed = _train(tmp_path / "packed", *layout, *extra)
    assert packed.returncode == 0, packed.stderr[-2000:]
    record = json.loads((tmp_path / "packed" / "packing.json").read_text())
    assert record["start_ep"] == 2 and record["ep"] in (1, 2) and record["decisions"]
    assert [c["ep"] for c in record["candidates"]] == [2, 1]
    assert "expert packing (Lina)" in packed.stderr
    if "--microbatching" in layout:  # the planned engine ran, its plans for the chosen size's lockstep ranks
        assert all(r["micro_batches"] >= 1 and "plan_wait_s" in r for r in _metrics(tmp_path / "packed"))
    fixed = _train(tmp_path / "fixed", *layout, "moe.num_experts=4", "planner.costs=a100",
                   f"parallel.ep={record['ep']}")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert [r["loss"] for r in _metrics(tmp_path / "packed")] == [r["loss"] for r in _metrics(tmp_path / "fixed")]
    state = json.loads((tmp_path / "packed" / "ckpt-0000008" / "state.json").read_text())
    assert state["layout"]["ep"] == record["ep"]
    resumed = run_cli("train", "--steps", "10", "--out", str(tmp_path / "packed"), "--resume", *layout, *TINY,
                      *extra)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "expert packing (Lina)" not in resumed.stderr  # read from packing.json, not measured again
    assert [r["step"] for r in _metrics(tmp_path / "packed")] == list(range(1, 11))


def test_a_validation_set_too_small_for_a_pipeline_stage_s_ranks_is_refused_before_training(tmp_path):
    """2 stages x 2 data-parallel ranks and a validation split of one row: every rank of a stage needs a row, so
    the job stops at the start with the fix, not at its first validation after the training steps before it."""
    text = tmp_path / "one.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(48)))
    out = tmp_path / "run"
    r = run_cli("train", "--steps", "4", "--seed", "0", "--out", str(out), *TINY, "--nproc", "4", "--pp", "2",
                f"data.source={text}", "data.val_fraction=0.05", "data.max_bytes=null", "train.eval_every=2")
    assert r.returncode == 2 and "every rank needs a row" in r.stderr, r.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
