"""Stopping a job as a scheduler does: `kill -TERM` of the `moebal train --nproc 2` launcher stops and waits for
its ranks, and while the job runs its run directory refuses a second job (docs/training.md, Guarantees)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moebal.distributed.testing import rank_pid
from tests.cli_util import run_cli
from tests.integration.test_restart import TINY


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def _wait_for(ready, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job did not reach its first checkpoint in time"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_stops_the_ranks_and_a_live_run_directory_refuses_a_second_job(tmp_path):
    name, value = "MOEBAL_TEST_JOB", uuid.uuid4().hex
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moebal.cli", "train", "--nproc", "2", "--steps", "100000", "--out", str(run),
           *TINY]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, name: value})
    pids: list[int | None] = []
    try:
        _wait_for(lambda: (run / "ckpt-0000004").is_dir(), job)
        pids = [rank_pid(r, f"{name}={value}") for r in (0, 1)]
        assert all(pids), pids
        second = run_cli("train", "--out", str(run), "--resume")  # in this process (tests/cli_util.py)
        assert second.returncode == 2, second.stderr
        [line] = second.stderr.strip().splitlines()  # one line, naming the live owner
        assert line.startswith(f"moebal train: error: {run} is in use by another job: PID {job.pid} on host "
                               f"{socket.gethostname()} (since ")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
        assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "moebal train: interrupted (SIGTERM)" in err
        assert not [p for p in pids if p and _running(p)], "a rank outlived its launcher"
    finally:
        job.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]


def test_a_hung_rank_fails_with_its_stacks_instead_of_hanging(tmp_path):
    # a store that accepts the connection and never answers: the rank waits in its rendezvous
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(silent.getsockname()[1]),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "MOEBAL_HANG_TIMEOUT_S": "10"}  # start-up takes 3-5 s
        t0 = time.monotonic()
        rank = subprocess.run([sys.executable, "-m", "moebal.cli", "train", "--out", str(tmp_path / "run"), *TINY],
                              capture_output=True, text=True, timeout=300, env=env)
    assert rank.returncode == 1 and time.monotonic() - t0 < 120
    assert "Timeout (0:00:10)!" in rank.stderr and "most recent call first" in rank.stderr
    assert "init_process_group" in rank.stderr  # where it hung, in the stack it printed
