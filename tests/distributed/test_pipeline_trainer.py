"""The trainer's services on the pipeline path: validation, the time limit and the progress display.

Pipeline runs go through the same `Trainer` loop as single-process runs (a `PipelineStep` strategy). Its
validation runs the stages forward only and must equal the single-process validation loss of the same
weights; `train.eval_every`, `train.time_limit_min` and `train.progress` act as in a single-process run. One
spawned job of 2 gloo ranks (2 stages) runs every case on a tiny fp32 MoE model.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_for(pp: int = 2, **train: object) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop"},
        "data": {"seq_len": 16, "batch_size": 4, "max_bytes": 200_000},
        "train": {"steps": 4, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "eval_batches": 2,
                  "precision": "fp32", "threads": 1, "ckpt_every": 0, "progress": "plain", **train},
        "parallel": {"pp": pp, "nproc": pp, "ep": 1}, "planner": {"costs": "a100"},
        "pipeline": {"micro_batches": 2}})


def _train(rank: int, dims: object, cfg: Config, out: Path, resume: bool = False) -> tuple[object, object, str]:
    """One pipeline run of the job: (trainer, result, what the progress display wrote on this rank)."""
    import torch.distributed as dist

    from moebal.train.pipelined import pipeline_trainer

    err = io.StringIO()
    trainer = pipeline_trainer(cfg, out, resume=resume, dims=dims)
    try:
        with contextlib.redirect_stderr(err):
            result = trainer.train()
    finally:
        trainer.close()
    dist.barrier()  # rank 0 has completed the run's last checkpoint before any rank starts the next run
    return trainer, result, err.getvalue()


def _single_process_val(cfg: Config, state: dict, out: Path) -> float:
    """The single-process trainer's validation loss of the model with the pipeline's weights."""
    import dataclasses

    import torch

    from moebal.models import build_model
    from moebal.train import Trainer

    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, nproc=1))
    model = build_model(one)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())], missing
    val = Trainer(one, out, model=model).evaluate()
    assert val is not None
    return val


def _job(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims

    base, res = Path(tmp), {}
    dims = ParallelDims(world_size=world, rank=rank, pp=2, ep=1).init()
    # validation of the trained weights, forward only through the stages, against one process
    trainer, result, _ = _train(rank, dims, cfg_for(), base / "val")
    state = {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}  # full-model names
    states: list = [None] * world
    dist.all_gather_object(states, state)
    if rank == 0:
        res["pipeline_val"] = result.val_loss
        res["single_val"] = _single_process_val(cfg_for(), {k: v for s in states for k, v in s.items()},
                                                base / "single")
    # eval_every: validation at steps 2 and 4 (the last) only, on the pipeline path too
    _, _, res["progress"] = _train(rank, dims, cfg_for(eval_every=2), base / "every")
    # time_limit_min: over when step 1 ends; stops like a finished run, then --resume finishes it
    _, stopped, _ = _train(rank, dims, cfg_for(time_limit_min=1e-6), base / "limit")
    _, finished, _ = _train(rank, dims, cfg_for(), base / "limit", resume=True)
    res["stopped"] = (stopped.steps, stopped.stopped_early, stopped.val_loss)
    res["finished"] = (finished.steps, finished.stopped_early)
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("pipeline_trainer")
    return run_ranks(_job, 2, str(tmp), timeout_s=300)[0], tmp


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_validation_equals_single_process_validation_of_the_same_weights(job):
    res, tmp = job
    got, want = res["pipeline_val"], res["single_val"]
    assert got is not None and abs(got - want) <= 1e-5 * want, (got, want)
    assert _lines(tmp / "val")[-1]["val_loss"] == got  # the last step validates


def test_pipeline_validates_every_eval_every_steps(job):
    _, tmp = job
    lines = _lines(tmp / "every")
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert [r["step"] for r in lines if "val_loss" in r] == [2, 4]


def test_pipeline_shows_progress(job):
    res, _ = job
    shown = [line for line in res["progress"].splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in shown] == ["1/4", "2/4", "3/4", "4/4"], res["progress"]
    assert " val " in shown[1] and " val " not in shown[0]


def test_pipeline_time_limit_stops_early_like_a_finished_run_and_resume_finishes(job):
    res, tmp = job
    steps, why, val = res["stopped"]
    assert steps == 1 and why and "time_limit_min" in why and val is not None
    assert res["finished"] == (4, None)
    lines = _lines(tmp / "limit")
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and "val_loss" in lines[0]
    assert (tmp / "limit" / "ckpt-0000001").is_dir() and (tmp / "limit" / "dashboard.svg").is_file()
