"""Plan-ahead's online path profile resumes exactly (`planner.plan_ahead: path`, no `path_profile`).

A run is interrupted after a checkpoint taken between two profile builds (a copy of the uninterrupted run's
directory without its later checkpoint) and resumed: its losses are bitwise the uninterrupted run's, and so are
the layers planned ahead and the replicas of every step from `metrics.jsonl`. The checkpoint carries each
rank's routing window, the refresh counter and the samples taken since the last build
(`PlanAhead.window_tensors`); without them the resumed run would fall back to the previous-iteration placement
until its first build, `path_refresh` steps after the resume, and place other replicas. Expert parallelism on
2 gloo ranks (the trainer's hook) and 2 stages x 2 expert shards on 4 (inside stages).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import time
from pathlib import Path

import pytest

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks


def _cfg(steps: int, ckpt_every: int, refresh: int, window: int, **parallel: int) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 4 if parallel else 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32",
                  "ckpt_every": ckpt_every, "keep_checkpoints": 10, "progress": "plain", "threads": 1},
        # a hardware profile (not timing this job) and no hysteresis: the same plans in every run, with replicas
        "planner": {"policy": "prophet", "costs": "rtx3090", "hysteresis": 0.0, "plan_ahead": "path",
                    "path_len": 1, "path_refresh": refresh, "path_window": window},
        "parallel": parallel, "pipeline": {"micro_batches": 2}})


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _interrupted(rank: int, whole: Path, to: Path, drop: str) -> Path:
    """The run `whole` as it stood before checkpoint `drop` (rank 0 copies; every rank waits)."""
    import torch.distributed as dist

    if rank == 0:
        shutil.copytree(whole, to)
        shutil.rmtree(to / drop)
    dist.barrier()
    return to


def _ep_run(cfg: Config, out: Path, resume: bool) -> None:
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    ctx, model, hooks = setup_parallel(cfg, run_dir=out)
    trainer = Trainer(cfg, out, model=model, hooks=hooks, ctx=ctx, resume=resume)
    try:
        trainer.train()
    finally:
        trainer.close()


def _pp_run(cfg: Config, out: Path, resume: bool) -> None:
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    dims = ParallelDims(world_size=dist.get_world_size(), rank=dist.get_rank(), pp=2, ep=2).init()
    trainer = pipeline_trainer(cfg, out, resume=resume, dims=dims)
    try:
        trainer.train()
    finally:
        trainer.close()


def _worker(rank: int, world: int, root: str, kind: str) -> dict | None:
    """The uninterrupted run, then the run resumed from its middle checkpoint; rank 0 returns both metrics."""
    import torch.distributed as dist

    base = Path(root)
    if kind == "ep":  # builds after steps 3 and 6, the checkpoint after 4 (one sample since the last build)
        cfg, run, drop = _cfg(8, 4, refresh=3, window=4), _ep_run, "ckpt-0000008"
    else:  # builds after steps 2, 4, 6, the checkpoint after 3
        cfg, run, drop = _cfg(6, 3, refresh=2, window=3, pp=2, ep=2, nproc=4), _pp_run, "ckpt-0000006"
    run(cfg, base / "whole", False)
    dist.barrier()
    part = _interrupted(rank, base / "whole", base / "part", drop)
    started = time.time()
    run(cfg, part, True)
    dist.barrier()
    if rank != 0:
        return None
    plans = {k: (d / "plans.jsonl").read_text().splitlines() for k, d in (("whole", base / "whole"), ("part", part))
             if (d / "plans.jsonl").is_file()}
    return {"whole": _metrics(base / "whole"), "part": _metrics(part), "started": started, "plans": plans}


def _check_exact(out: dict, resumed_from: int, ahead_after: int) -> None:
    whole, part = out["whole"], out["part"]
    steps = [r["step"] for r in whole]
    assert [r["step"] for r in part] == steps
    # the lines after the checkpoint are the resumed run's own (the copy held the uninterrupted run's)
    assert all(r["time"] >= out["started"] for r in part if r["step"] > resumed_from)
    assert [r["loss"] for r in part] == [r["loss"] for r in whole]
    assert [r["plan_ahead_layers"] for r in part] == [r["plan_ahead_layers"] for r in whole]
    assert [r["replicas"] for r in part] == [r["replicas"] for r in whole]
    for key in ("plan_ahead_path_overlap", "plan_ahead_path_rel_mae"):
        assert [r.get(key) for r in part] == [r.get(key) for r in whole], key
    # the resumed steps planned ahead from the restored profile at once, and placed replicas there
    after = [r for r in whole if r["step"] > resumed_from]
    assert after[0]["plan_ahead_layers"], after[0]
    assert all(r["plan_ahead_layers"] for r in whole if r["step"] > ahead_after)
    assert any(r["replicas"][j] > 0 for r in after for j in r["plan_ahead_layers"])


@pytest.fixture(scope="module")
def ep_job(tmp_path_factory) -> tuple[Path, dict]:
    """The 2-rank expert-parallel job (uninterrupted, then resumed): its directory and rank 0's results."""
    root = tmp_path_factory.mktemp("plan_ahead_ep")
    return root, run_ranks(_worker, 2, str(root), "ep", timeout_s=600)[0]


def test_expert_parallel_resume_continues_the_online_profile_exactly(ep_job):
    out = ep_job[1]
    _check_exact(out, resumed_from=4, ahead_after=3)
    assert [r["plan_ahead_layers"] for r in out["whole"]][:3] == [[], [], []]  # before the first build
    # plans.jsonl line for line: the placements used (ahead ones included) and planned, with their predictions
    plans = out["plans"]
    assert len(plans["whole"]) == 8 and plans["part"] == plans["whole"]


def test_resume_inside_pipeline_stages_continues_the_online_profile_exactly(tmp_path):
    out = run_ranks(_worker, 4, str(tmp_path), "pp", timeout_s=600)[0]
    _check_exact(out, resumed_from=3, ahead_after=2)


def _on_four(rank: int, world: int, root: str) -> dict | None:
    """The 2-rank run's step-4 checkpoint resumed on 4 ranks (expert parallelism 4), rank 0's stderr kept."""
    import torch.distributed as dist

    part = _interrupted(rank, Path(root) / "whole", Path(root) / "four", "ckpt-0000008")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        _ep_run(_cfg(8, 4, refresh=3, window=4), part, True)
    dist.barrier()
    return {"part": _metrics(part), "said": said.getvalue()} if rank == 0 else None


def test_under_another_expert_parallel_size_the_online_profile_starts_empty_and_says_why(ep_job):
    """4 token shards instead of 2: every rank's tokens are another slice of the batch, so no rank continues
    its saved window; the profile is built again `path_refresh` (3) steps after the resume, the run says why,
    and the losses are the uninterrupted run's up to summation order."""
    root, whole = ep_job[0], ep_job[1]["whole"]
    out = run_ranks(_on_four, 4, str(root), timeout_s=600)[0]
    part = out["part"]
    assert [r["step"] for r in part] == list(range(1, 9))
    assert [r["plan_ahead_layers"] for r in part][4:] == [[], [], [], [1, 2]]
    assert "starts empty on resume: it was saved with 2 token shards per stage" in out["said"]
    assert "this run has 4" in out["said"]
    for a, b in zip(whole, part):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])


def _no_ep(rank: int, world: int, root: str) -> None:
    _pp_run_dims(_cfg(2, 0, refresh=1, window=1, pp=2), Path(root), ep=1)


def _pp_run_dims(cfg: Config, out: Path, ep: int) -> None:
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import pipeline_ep
    from moebal.train.pipelined import pipeline_trainer

    world = dist.get_world_size()
    assert pipeline_ep(cfg, world) == ep  # neither parallel.ep nor parallel.nproc: world / pp
    dims = ParallelDims(world_size=world, rank=dist.get_rank(), pp=2, ep=ep).init()
    pipeline_trainer(cfg, out, dims=dims).close()


def test_stages_without_expert_parallelism_refuse_plan_ahead_at_start_up(tmp_path):
    """The config check passes (it cannot see the stage's size); the stages refuse, naming the resolved size."""
    with pytest.raises(RuntimeError, match=r"parallel.ep resolved to 1: 2 ranks over parallel.pp 2 stages"):
        run_ranks(_no_ep, 2, str(tmp_path), timeout_s=300)
