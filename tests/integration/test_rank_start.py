"""How `moebal train --nproc N` starts its ranks (moebal/launch/spawn.py): forked from the launcher's preloaded
forkserver by default, fresh interpreters with MOEBAL_RANK_START=exec; both train the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_train import TINY

ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, start: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEBAL_RANK_START": start}
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.eval_every="))]
    return subprocess.run([sys.executable, "-m", "moebal.cli", "train", "--nproc", "2", "--steps", "2", "--seed",
                           "0", "--out", str(out), *tiny, "train.eval_every=2",
                           # two jobs compared bit for bit: Pro-Prophet's placements (and the all-to-all's chunks)
                           # planned on a fixed profile, not on each job's own start-up measurement
                           "planner.costs=a100", *extra],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def test_forked_and_exec_ranks_give_the_same_losses(tmp_path: Path) -> None:
    forked = _train(tmp_path / "forked", "forkserver")
    assert forked.returncode == 0, forked.stderr[-3000:]
    fresh = _train(tmp_path / "exec", "exec")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert _losses(tmp_path / "forked") == _losses(tmp_path / "exec") and len(_losses(tmp_path / "exec")) == 2
    assert "Warning" not in forked.stderr and "Traceback" not in forked.stderr, forked.stderr[-3000:]


def test_an_unknown_rank_start_is_one_clear_line(tmp_path: Path) -> None:
    r = _train(tmp_path / "run", "thread")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == ("moebal train: error: MOEBAL_RANK_START='thread' is not a way to start ranks; use "
                                "one of forkserver, exec (or unset it: forkserver)")
