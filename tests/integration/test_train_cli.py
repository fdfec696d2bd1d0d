"""`moebal train` end to end: the first run as a user runs it (`python -m moebal.cli`, a process of its own), the
others in the test process (tests/cli_util.py: the same exit code, stdout and stderr, without a new interpreter
importing torch each time)."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys

from tests.cli_util import ROOT, Ran, run_cli
from tests.unit.test_train import TINY


def moebal_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`moebal train *args` as a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "moebal.cli", "train", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


def moebal(*args: str) -> Ran:
    """`moebal train *args` in this process."""
    return run_cli("train", *args)


def test_cli_runs_writes_the_run_directory_and_resumes(tmp_path):
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith("train.steps=")]  # --steps sets it (both would be refused)
    r = moebal_process("--steps", "3", "--out", str(out), *tiny, "train.ckpt_every=2")
    assert r.returncode == 0, r.stderr
    # parallel.shard auto, the default: settled from the memory plan before the run starts and kept in
    # config.yaml; none (nothing sharded, as the run would be without auto) goes unsaid
    assert "parallel.shard auto" not in r.stderr, r.stderr
    assert "  shard: none\n" in (out / "config.yaml").read_text(encoding="utf-8")
    assert {"config.yaml", "metrics.jsonl", "dashboard.svg", "summary.json", "ckpt-0000002", "ckpt-0000003"} <= \
        {p.name for p in out.iterdir()}
    assert "validation" in r.stdout and "unigram entropy" in r.stdout and str(out) in r.stdout
    assert "Traceback" not in r.stderr
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["steps"] == 3 and summary["val_loss"] < summary["unigram_entropy"] * 2
    assert summary["val_ratio"] == summary["val_loss"] / summary["unigram_entropy"]
    # a second run into the same directory must say how to continue instead of overwriting
    again = moebal("--steps", "3", "--out", str(out), *tiny)
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr
    # --resume without CONFIG continues from the run's own config.yaml; more steps extend it
    r2 = moebal("--out", str(out), "--resume", "--steps", "5", "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout.strip().splitlines()[-1])["steps"] == 5
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    # resuming a run that has reached its steps trains nothing and says so; its record stays as it was
    before = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "config.yaml")}
    for steps_arg in ("5", "4"):
        r3 = moebal("--out", str(out), "--resume", "--steps", steps_arg)
        assert r3.returncode == 0, r3.stderr
        assert f"is at step 5 and train.steps is {steps_arg}: nothing to train" in r3.stderr, r3.stderr
        assert "nan" not in r3.stdout + r3.stderr
        assert {name: (out / name).read_bytes() for name in before} == before
    # --resume-from a checkpoint into a new directory (a branch) without CONFIG takes the checkpoint's config:
    # the branch's step 5 is the run's step 5 (it once took the default config and failed on the shapes)
    branch = tmp_path / "branch"
    r4 = moebal("--resume-from", str(out / "ckpt-0000004"), "--out", str(branch), "--steps", "5")
    assert r4.returncode == 0, r4.stderr
    loss = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [json.loads(x)["loss"] for x in (branch / "metrics.jsonl").read_text(encoding="utf-8").splitlines()] \
        == loss[4:]
    # ... but not into a directory holding another run: its checkpoints and metrics would be replaced
    def files() -> dict[str, bytes]:  # the run's files (the lock records the job that holds the directory)
        return {p.name: p.read_bytes() for p in branch.rglob("*") if p.is_file() and p.name != "moebal.lock"}

    kept = files()
    r5 = moebal("--resume-from", str(out / "ckpt-0000004"), "--out", str(branch), "--steps", "6")
    assert r5.returncode == 2 and "is a checkpoint of another run" in r5.stderr, r5.stderr
    assert files() == kept
    # the run's config.yaml lost (empty: a write a crash cut short): --resume takes its newest checkpoint's, not
    # the defaults (whose model the checkpoint does not fit)
    (out / "config.yaml").write_text("", encoding="utf-8")
    r6 = moebal("--out", str(out), "--resume", "--steps", "5")
    assert r6.returncode == 0 and "is at step 5 and train.steps is 5: nothing to train" in r6.stderr, r6.stderr


def test_cli_errors_are_one_clear_line(tmp_path):
    cases = [
        (["model.dimm=3"], "did you mean 'model.dim'"),
        (["data.source=" + str(tmp_path / "missing")], "does not exist"),
        (["--out", str(tmp_path / "none"), "--resume"], "nothing to resume"),
        (["--resume"], "--resume needs --out"),
        (["--steps", "2"], "--steps and the override train.steps=1 both set train.steps: give one of them"),
        (["--out", str(tmp_path / "a"), "--resume", "--resume-from", str(tmp_path / "a" / "ckpt-0000001")],
         "--resume (the newest checkpoint of --out) and --resume-from CKPT (a chosen one) conflict"),
        # restarts need a launcher of several ranks (one process ignored them)
        (["--out", str(tmp_path / "r1"), "--nproc", "1", "--max-restarts", "2"],
         "--max-restarts 2 restarts the ranks of a --nproc N job (N > 1), and this run is one process"),
        (["--out", str(tmp_path / "r2"), "--nproc", "1", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    ]
    for args, expect in cases:
        r = moebal(*args, "train.steps=1")
        assert r.returncode == 2, (args, r.stderr)
        assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_full_disk_is_one_line_and_the_leftover_does_not_block_the_resume(tmp_path, monkeypatch, capsys):
    from moebal.cli import main
    from moebal.train import checkpoint

    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith("train.steps=")]
    real = checkpoint._fsync_write

    def full_at_step_4(path, data):
        if ".ckpt-0000004." in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(checkpoint, "_fsync_write", full_at_step_4)
    assert main(["train", "--steps", "4", "--out", str(out), *tiny, "train.ckpt_every=2", "parallel.nproc=1"]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert line.startswith(f"moebal train: error: cannot write checkpoint 4 into {out}: No space left on device")
    assert [p.name for p in out.glob(".ckpt-*.tmp")]  # what the failed save left (taking the freed space)
    monkeypatch.undo()
    assert main(["train", "--out", str(out), "--resume", "--steps", "4"]) == 0
    assert not list(out.glob(".ckpt-*.tmp")) and (out / "ckpt-0000004").is_dir()
    assert "resumed at step 2" in capsys.readouterr().err


def test_an_unwritable_run_directory_and_an_impossible_size_are_one_line(tmp_path):
    for args, expect in [(["--out", "/proc/nope/run"], "cannot create the run directory /proc/nope/run: "),
                         (["model.dim=1e12", "--out", str(tmp_path / "big")], "parameters (model.dim="),
                         (["model.dim=1e24", "--out", str(tmp_path / "big")], "beyond any run (at most 2**62)")]:
        r = moebal(*args, "train.steps=1")
        assert r.returncode == 2 and expect in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "big").exists()  # refused before anything was created


def test_a_diverged_run_stops_at_its_first_non_finite_step_and_keeps_its_checkpoints(tmp_path):
    """An absurd learning rate without clipping: the first step whose loss or gradient norm is not finite ends
    the run with one line naming the newest checkpoint (written at a finite step, untouched) and the settings to
    change; the metrics keep the bad step for diagnosis, and no checkpoint of the diverged state is written."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.ckpt_every=", "train.warmup_steps="))]
    r = moebal("--out", str(out), *tiny, "train.steps=30", "train.lr=1000", "train.grad_clip=0",
               "train.warmup_steps=0", "train.ckpt_every=1", "train.keep_checkpoints=2", "parallel.nproc=1")
    assert r.returncode == 2, r.stderr
    assert "training diverged" in r.stderr and "train.grad_clip above 0" in r.stderr, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bad = records[-1]
    assert not all(map(math.isfinite, (bad["loss"], bad["grad_norm"]))), bad
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in records[:-1])
    ckpts = sorted(p.name for p in out.glob("ckpt-*"))
    assert ckpts == [f"ckpt-{bad['step'] - 2:07d}", f"ckpt-{bad['step'] - 1:07d}"], ckpts
    assert f"the newest checkpoint, {out / ckpts[-1]}, is untouched" in r.stderr, r.stderr


def test_rollbacks_go_back_to_the_newest_checkpoint_until_their_maximum_then_stop(tmp_path):
    """`train.spike.action=rollback`: each bad step goes back to the newest checkpoint in the same process (the
    start-up line again, resumed there), skipping the batches since it; at train.spike.max_rollbacks the next
    bad step stops the run as `stop` would, naming the rollbacks made. The first update at learning rate 1000
    wrecks the weights, so every later step is bad from the first checkpoint on: called a spike at once (3x the
    previous step's loss), it does not wait for the loss or the gradient to overflow, which depends on the
    kernels' rounding (with non-finite steps alone, a run once collapsed to the uniform loss and went bad only
    steps later, after newer checkpoints)."""
    out = tmp_path / "run"
    tiny = [x for x in TINY if not x.startswith(("train.steps=", "train.ckpt_every=", "train.warmup_steps="))]
    r = moebal("--out", str(out), *tiny, "train.steps=30", "train.lr=1000", "train.grad_clip=0",
               "train.warmup_steps=0", "train.ckpt_every=1", "parallel.nproc=1", "train.spike.action=rollback",
               "train.spike.max_rollbacks=2", "train.spike.factor=3", "train.spike.window=1")
    assert r.returncode == 2, r.stderr
    rolled = [line for line in r.stderr.splitlines() if "rolled back to" in line]
    assert len(rolled) == 2 and "(rollback 2 of at most 2), skipping 2 batches" in rolled[1], r.stderr
    assert r.stderr.count("resumed at step") == 2, r.stderr
    assert "the loss spiked and stopped without saving this state (the run has made its " \
           "train.spike.max_rollbacks (2) rollbacks)" in r.stderr, r.stderr
    records = [json.loads(line) for line in (out / "rollbacks.jsonl").read_text().splitlines()]
    assert [x["skipped_batches"] for x in records] == [1, 2] and records[0]["resume_step"] == records[1]["resume_step"]
    assert not (out / "summary.json").exists()


def test_a_run_started_with_relative_data_paths_resumes_from_another_directory(tmp_path):
    """config.yaml keeps the input paths absolute (moebal.config.absolute_inputs), so `--resume` from another
    working directory finds the data; a path that does not exist is left for the loader to name."""
    import yaml

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}\n" for i in range(400))
    (work / "data" / "a.txt").write_text(text)
    (work / "data" / "b.txt").write_text(text.upper())
    for k, source in enumerate(("data.source=data/a.txt", "data.mixture={data/a.txt: 1, data/b.txt: 2}")):
        run = tmp_path / f"run{k}"
        first = run_cli("train", "--out", str(run), *TINY, source, "train.steps=3", "train.ckpt_every=2",
                        "data.val_fraction=0", "train.eval_every=0", cwd=work)
        assert first.returncode == 0, first.stderr[-2000:]
        data = yaml.safe_load((run / "config.yaml").read_text())["data"]
        names = list(data["mixture"]) if data["mixture"] else [data["source"]]
        assert all(os.path.isabs(n) and n.startswith(str(work)) for n in names), names
        resumed = run_cli("train", "--steps", "5", "--out", str(run), "--resume", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4, 5], steps
    missing = run_cli("train", "--out", str(tmp_path / "x"), *TINY, "data.source=nothere.txt", cwd=work)
    assert missing.returncode != 0 and "work/nothere.txt' does not exist" in missing.stderr, missing.stderr
