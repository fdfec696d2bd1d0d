"""Restarts: a rank SIGKILLed mid-run restarts the job from its last checkpoint, and the run ends with exactly the
losses of an uninterrupted one (fixed seed; weights, optimizer, data position and RNG restored by resume).

The planner's coefficients come from a hardware profile (`planner.costs=a100`), not from timing the live job:
the two runs compared would each measure their own figures, pick different replicas and so sum in another
order. (Within one run a restart reuses the run's first measurement, which travels in the checkpoints.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moebal.distributed.testing import kill_rank_when
from tests.cli_util import run_cli

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
        "moe.num_experts=4", "moe.expert_ffn_dim=64", "data.seq_len=64", "data.batch_size=4",
        "data.max_bytes=400000", "train.precision=fp32", "train.eval_every=4", "train.eval_batches=2",
        "train.warmup_steps=2", "train.ckpt_every=4", "train.threads=1", "planner.costs=a100"]
STEPS = 30


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", "--nproc", "2", "--steps", str(STEPS), "--seed", "0", "--out", str(out), *TINY, *extra]


def _cmd(out: Path, *extra: str) -> list[str]:
    """The job as a process of its own: its rank is killed, and its launcher restarts the job."""
    return [sys.executable, "-m", "moebal.cli", *_args(out, *extra)]


LAYOUTS = {"expert-parallel": [], "pipeline": ["--pp", "2", "model.n_layers=4"]}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_rank_restarts_from_the_last_checkpoint_with_the_same_losses(tmp_path, layout):
    ref = run_cli(*_args(tmp_path / "ref", *LAYOUTS[layout]))  # in this process (tests/cli_util.py)
    assert ref.returncode == 0, ref.stderr[-2000:]
    marker = f"MOEBAL_TEST_JOB={uuid.uuid4().hex}"
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run, "--max-restarts", "1", *LAYOUTS[layout]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True, env={**os.environ, marker.split("=")[0]: marker.split("=")[1]})
    try:
        killed = kill_rank_when(lambda: (run / "ckpt-0000004").is_dir(),  # complete: every shard is in
                                rank=1, marker=marker, alive=lambda: proc.poll() is None)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "rank 1 failed (signal 9); restarting every rank from the last checkpoint (restart 1 of 1)" in err
    if layout == "expert-parallel":  # (the pipeline runner prints no start-up line)
        resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", err)]
        assert len(resumed) == 1 and 4 <= resumed[0] < STEPS
    a, b = _metrics(tmp_path / "ref"), _metrics(run)
    assert [x["step"] for x in b] == list(range(1, STEPS + 1))
    # resumed, not started over: the checkpoint's steps keep the lines logged before the kill
    assert b[3]["time"] < killed < b[-1]["time"]
    assert [x["loss"] for x in b] == [x["loss"] for x in a]
    assert [x.get("val_loss") for x in b] == [x.get("val_loss") for x in a]


def test_bad_input_is_not_restarted(tmp_path):
    # a corrupt checkpoint shard is refused by each rank as it loads, with exit code 2, which a restart would
    # repeat (bad input the launcher can see, such as a batch the ranks cannot split, never reaches a rank)
    run = tmp_path / "bad"
    assert run_cli("train", "--nproc", "2", "--steps", "4", "--seed", "0", "--out", str(run), *TINY).returncode == 0
    shard = next((run / "ckpt-0000004").glob("optim-*.safetensors"))  # TINY checkpoints every 4 steps
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = run_cli("train", "--nproc", "2", "--steps", "6", "--out", str(run), "--resume", "--max-restarts", "2")
    assert bad.returncode == 2
    assert "is corrupt" in bad.stderr and "failed (exit code 2); stopped the other ranks" in bad.stderr, bad.stderr
    assert "restarting" not in bad.stderr
