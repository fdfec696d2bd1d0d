"""`--resume` under another parallel layout continues the same run: 1 -> 2 -> 4 -> 1 expert-parallel ranks.

Each leg resumes from the previous leg's checkpoint, written by a different number of ranks, and its losses
must match one uninterrupted single-process run. The tolerance is the expert-parallel parity tests' (1e-5
relative), not bitwise: a different number of ranks sums the same gradients in a different order (the
all-to-all gathers an expert's rows from every rank, dense gradients are all-reduced over the ranks).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_train_distributed import TINY

STEPS = 8
LEGS = [1, 2, 4, 1]  # ranks of each 2-step leg


def _run(out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "moebal.cli", "train", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_resume_under_1_2_4_1_expert_parallel_ranks_keeps_the_losses(tmp_path):
    common = ["--seed", "0", *TINY, "train.ckpt_every=2", f"train.keep_checkpoints={STEPS}", "train.eval_every=0"]
    whole = tmp_path / "whole"
    _run(whole, "--steps", str(STEPS), "--nproc", "1", *common)
    want = _losses(whole)
    run = tmp_path / "run"
    shutil.copytree(whole, run)  # leg 1 (1 rank, steps 1-2) is the whole run's start
    for leg, ranks in enumerate(LEGS[1:], start=1):
        step = 2 * leg  # resume from here: the previous leg (another number of ranks) wrote this checkpoint
        for later in (p for p in run.glob("ckpt-*") if int(p.name[5:]) > step):
            shutil.rmtree(later)
        _run(run, "--resume", "--nproc", str(ranks))
        got = _losses(run)
        assert sorted(got) == list(range(1, STEPS + 1))
        for s in (step + 1, step + 2):
            assert abs(got[s] - want[s]) <= 1e-5 * want[s], (ranks, s, got[s], want[s])
        manifest = json.loads((run / f"ckpt-{step + 2:07d}" / "manifest.json").read_text())
        writers = {e["file"] for e in manifest["tensors"].values()}
        assert len({f for f in writers if f.startswith("model-")}) == ranks  # every rank wrote its experts
