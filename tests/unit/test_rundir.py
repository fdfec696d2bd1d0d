"""The run-directory lock: one live job per run directory, a dead job's lock never blocks, errors are one line."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from moebal.errors import ConfigError
from moebal.train.rundir import LOCK_ENV, LOCK_NAME, lock_run_dir

HOLDER = textwrap.dedent("""\
    import sys, time
    from moebal.train.rundir import lock_run_dir
    lock = lock_run_dir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
    """)


def _holder(run):
    """A separate process holding the lock of `run` until it is killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "locked\n"
    return p


def test_a_live_job_refuses_a_second_and_a_killed_one_blocks_nothing(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(ConfigError) as e:
            lock_run_dir(run)
        assert f"{run} is in use by another job: PID {holder.pid} on host {socket.gethostname()}" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with lock_run_dir(run) as lock:  # kill -9 released it: no stale lock to delete by hand
        assert lock.held
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match="in use by another job"):
            lock_run_dir(run)  # even from the same process: one job, one holder
    with lock_run_dir(run):
        pass


def test_without_flock_the_recorded_owner_decides(tmp_path, monkeypatch, capsys):
    def no_flock(*a: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = {"host": socket.gethostname(), "pid": int(dead.stdout), "time": 0}
    (run / LOCK_NAME).write_text(json.dumps(owner))
    with lock_run_dir(run):
        assert f"{run / LOCK_NAME} is a stale lock (PID {owner['pid']} on host" in capsys.readouterr().err
    (run / LOCK_NAME).write_text(json.dumps({**owner, "pid": os.getppid()}))  # alive, on this host
    with pytest.raises(ConfigError, match=f"in use by another job: PID {os.getppid()} on host"):
        lock_run_dir(run)
    (run / LOCK_NAME).write_text(json.dumps({**owner, "host": "elsewhere"}))  # cannot be checked from here
    with pytest.raises(ConfigError, match=f"PID {owner['pid']} on host elsewhere .*delete {run / LOCK_NAME}"):
        lock_run_dir(run)


def test_an_unwritable_run_directory_is_one_line():
    with pytest.raises(ConfigError, match=r"^cannot create the run directory /proc/nope/run: .*choose a writable"):
        lock_run_dir("/proc/nope/run")


def test_ranks_work_under_their_launchers_lock(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with lock_run_dir(run):
        monkeypatch.setenv(LOCK_ENV, str((run / LOCK_NAME).resolve()))
        assert not lock_run_dir(run).held
        monkeypatch.delenv(LOCK_ENV)
        monkeypatch.setenv("RANK", "1")  # torchrun: rank 0 holds it
        assert not lock_run_dir(run).held


def test_a_job_that_fails_before_writing_leaves_no_directory_it_made(tmp_path):
    """A mistyped --out (a resume of nothing, bad data) fails with its one line and leaves no new directory; a
    directory that existed, or one the job wrote to, stays."""
    new = tmp_path / "typo" / "run"
    with pytest.raises(ConfigError, match="nothing here"), lock_run_dir(new):
        raise ConfigError("nothing here")
    assert not (tmp_path / "typo").exists() and tmp_path.is_dir()  # the folders it made, not the one that was
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(ConfigError), lock_run_dir(kept):
        raise ConfigError("x")
    assert kept.is_dir()
    wrote = tmp_path / "wrote"
    with pytest.raises(ConfigError), lock_run_dir(wrote):
        (wrote / "config.yaml").write_text("{}")
        raise ConfigError("x")
    assert (wrote / "config.yaml").is_file()
    with lock_run_dir(tmp_path / "fine"):
        pass
    assert (tmp_path / "fine" / LOCK_NAME).is_file()  # a job that ends normally keeps its directory


def test_a_mistyped_out_with_resume_leaves_nothing(tmp_path):
    from tests.cli_util import run_cli

    r = run_cli("train", "--out", str(tmp_path / "typo"), "--resume")
    assert r.returncode == 2 and "nothing to resume" in r.stderr, r.stderr
    assert not (tmp_path / "typo").exists()
