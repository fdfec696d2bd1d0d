"""`--resume` under another parallel layout continues the same run.

Each leg resumes from the previous leg's checkpoint, written under a different layout, and its losses must
match one uninterrupted run: bitwise when the layout is the same, else within the expert-parallel parity
tests' tolerance (1e-5 relative). Not bitwise because another layout adds the same numbers in another order:
with another number of expert-parallel ranks an expert's rows come from every rank through the all-to-all
and dense gradients are all-reduced over the ranks; a pipeline sums micro-batch losses and gradients where
a single process takes the batch whole.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.cli_util import run_cli
from tests.integration.test_train_distributed import TINY

STEPS = 10


def _run(out: Path, *extra: str) -> None:
    done = run_cli("train", "--out", str(out), *extra)  # in this process (tests/cli_util.py)
    assert done.returncode == 0, done.stderr[-3000:]


def _lines(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _losses(out: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in _lines(out).items()}


def _legs(tmp: Path, first: list[str], legs: list[tuple[list[str], bool]], *common: str) -> None:
    """Run STEPS steps under `first`, then resume its checkpoints leg by leg (2 steps each) under each leg's
    layout, comparing every leg's steps with the uninterrupted run (bitwise when the leg says so). The last
    leg runs to the end."""
    common = ("--seed", "0", *TINY, "train.ckpt_every=2", f"train.keep_checkpoints={STEPS}", "train.eval_every=0",
              *common)
    whole = tmp / "whole"
    _run(whole, "--steps", str(STEPS), *first, *common)
    want = _losses(whole)
    run = tmp / "run"
    shutil.copytree(whole, run)  # the first leg (steps 1-2) is the whole run's start
    for leg, (layout, bitwise) in enumerate(legs, start=1):
        step = 2 * leg  # resume from here: the previous leg wrote this checkpoint under its own layout
        for later in (p for p in run.glob("ckpt-*") if int(p.name[5:]) > step):
            shutil.rmtree(later)
        started = time.time()
        _run(run, "--resume", *layout)
        got = _losses(run)
        assert sorted(got) == list(range(1, STEPS + 1))
        # the leg trained its own steps: the lines after its checkpoint are its own (the run directory started as
        # a copy of the whole run's, metrics.jsonl included), the earlier ones were kept
        when = {s: r["time"] for s, r in _lines(run).items()}
        assert all(when[s] < started for s in range(1, step + 1)), (layout, when, started)
        assert all(when[s] >= started for s in range(step + 1, STEPS + 1)), (layout, when, started)
        for s in range(step + 1, step + 3 if leg < len(legs) else STEPS + 1):
            if bitwise:
                assert got[s] == want[s], (layout, s, got[s], want[s])
            else:
                assert abs(got[s] - want[s]) <= 1e-5 * want[s], (layout, s, got[s], want[s])


@pytest.mark.slow
def test_resume_under_other_expert_parallel_sizes_keeps_the_losses(tmp_path):
    """1 -> 2 -> 4 -> 2 -> 1 expert-parallel ranks."""
    _legs(tmp_path, ["--nproc", "1"], [(["--nproc", "2"], False), (["--nproc", "4"], False),
                                       (["--nproc", "2"], False), (["--nproc", "1"], False)])
    manifest = json.loads((tmp_path / "run" / "ckpt-0000006" / "manifest.json").read_text())
    files = {e["file"] for e in manifest["tensors"].values()}
    assert {f for f in files if f.startswith("model-")} == {f"model-r{r:05d}.safetensors" for r in range(4)}


@pytest.mark.slow
def test_resume_under_other_pipeline_and_expert_parallel_sizes_keeps_the_losses(tmp_path):
    """2 stages -> 2 stages (bitwise) -> 4 stages -> 2 stages x 2 expert shards -> 1 process."""
    pp = ["model.n_layers=4", "pipeline.micro_batches=2"]
    _legs(tmp_path, ["--nproc", "2", "--pp", "2"],
          [(["--nproc", "2", "--pp", "2"], True), (["--nproc", "4", "--pp", "4"], False),
           (["--nproc", "4", "--pp", "2"], False), (["--nproc", "1", "--pp", "1"], False)], *pp)


@pytest.mark.slow
def test_tied_embeddings_resume_under_other_stage_counts(tmp_path):
    """Tied embeddings (moebal/pipeline/tied.py): 2 stages -> 1 process -> 4 stages -> 2 stages. The checkpoint
    holds the embedding's moments once (the first stage's) and both names, as the single-process model's."""
    tied = ["model.n_layers=4", "pipeline.micro_batches=2", "model.tie_embeddings=true", "parallel.shard=none"]
    _legs(tmp_path, ["--nproc", "2", "--pp", "2"],
          [(["--nproc", "1", "--pp", "1"], False), (["--nproc", "4", "--pp", "4"], False),
           (["--nproc", "2", "--pp", "2"], False)], *tied)
