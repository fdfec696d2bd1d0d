"""`spawn_local`'s rendezvous: the job's store listens before any rank starts (no port race, no TCP self-connect);
and how a launcher takes a stop signal.

The ranks are a stand-in interpreter (`sys.executable` replaced, ranks exec'd) that records what it finds at
start-up and exits, so the test needs no torch process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from moebal.errors import ConfigError
from moebal.launch import spawn
from moebal.launch.spawn import spawn_local


def test_every_rank_finds_the_store_listening_when_it_starts(tmp_path, monkeypatch):
    # a rank that connected to MASTER_PORT before anything listened there could be handed that very port for its
    # own end by the kernel, connect to itself and wait for itself forever (the hang of a restarted job)
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, socket
        s = socket.socket()
        listening = s.connect_ex(("127.0.0.1", int(os.environ["MASTER_PORT"]))) == 0
        s.close()
        with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump({{"listening": listening, "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
                       "port": os.environ["MASTER_PORT"]}}, f)
        """), encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    # the stand-in runs only as an exec'd rank (a forked rank runs the forkserver's moebal); the store listens
    # before any rank starts whichever way ranks start (spawn_local opens it first)
    monkeypatch.setenv("MOEBAL_RANK_START", "exec")
    assert spawn_local(3, ["train"], max_restarts=0) == 0
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(s["listening"] and s["agent_store"] == "True" for s in seen), seen
    assert len({s["port"] for s in seen}) == 1
    with socket.socket() as s:  # the store went with the job
        assert s.connect_ex(("127.0.0.1", int(seen[0]["port"]))) != 0


def test_every_attempt_of_a_job_gets_the_job_s_start(tmp_path, monkeypatch):
    """A restart's ranks are given the first attempt's start, so `train.time_limit_min` is not started again."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys
        with open(os.path.join({str(tmp_path)!r}, "starts"), "a") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + " " + os.environ["MOEBAL_JOB_START"] + "\\n")
        sys.exit(1 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)  # the first attempt fails
        """), encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("MOEBAL_RANK_START", "exec")
    monkeypatch.setenv(spawn.JOB_START_ENV, "12.5")  # a value left in the launcher's shell is not the job's
    before = time.time()
    assert spawn_local(2, ["train"], max_restarts=1) == 0
    lines = (tmp_path / "starts").read_text().split()
    attempts, starts = lines[0::2], {float(x) for x in lines[1::2]}
    assert sorted(attempts) == ["0", "0", "1", "1"] and len(starts) == 1
    assert before - 0.01 <= starts.pop() <= time.time()


def test_a_rank_s_job_age_counts_from_the_launcher_s_start(monkeypatch):
    monkeypatch.setenv(spawn.JOB_START_ENV, str(time.time() - 120.0))
    monkeypatch.delenv("RANK", raising=False)
    assert spawn.job_age_s() == 0.0  # one process: a value left in the shell is ignored
    monkeypatch.setenv("RANK", "1")
    assert 119.0 < spawn.job_age_s() < 180.0
    monkeypatch.setenv(spawn.JOB_START_ENV, str(time.time() + 60.0))  # a node clock behind the launcher's
    assert spawn.job_age_s() == 0.0
    monkeypatch.delenv(spawn.JOB_START_ENV)  # a plain torchrun: the rank's own start-up
    assert spawn.job_age_s() == 0.0
    for bad in ("soon", "nan", "inf"):
        monkeypatch.setenv(spawn.JOB_START_ENV, bad)
        with pytest.raises(ConfigError, match="MOEBAL_JOB_START=.* is not a Unix time in seconds"):
            spawn.job_age_s()


def test_a_stop_signal_is_acted_on_between_polls_never_inside_one():
    # the handler only notes the signal: Stopped comes from the watch loop (or the block's end), so it cannot land
    # inside Popen.poll while that holds its wait lock, and stopping the child afterwards cannot hang
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(spawn.Stopped) as raised, spawn._stopped_by_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            went_on = True  # the handler did not raise here
            spawn._watch([child], 0.01)
        assert went_on and raised.value.signum == signal.SIGTERM
        spawn._stop([child], grace_s=5.0)
        assert child.returncode == -signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not spawn._pending
    finally:
        child.kill()
        child.wait()


def test_a_signal_after_the_last_check_still_stops_the_block():
    with pytest.raises(spawn.Stopped) as raised, spawn._stopped_by_signals():
        os.kill(os.getpid(), signal.SIGHUP)
    assert raised.value.signum == signal.SIGHUP


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_a_rank_killed_by_a_signal_is_named_before_the_peers_it_took_down():
    # rank 1 SIGKILLed, rank 0 failed on the closed connection, both seen in one poll: rank 1 is the cause
    assert spawn._watch([_Exited(1), _Exited(-signal.SIGKILL), _Exited(None)], 0.01) == (1, -signal.SIGKILL)
    assert spawn._watch([_Exited(1), _Exited(None), _Exited(3)], 0.01) == (0, 1)  # no signal: the lowest index
    assert spawn._watch([_Exited(0), _Exited(-15), _Exited(-9)], 0.01) == (1, -15)
    assert spawn._watch([_Exited(0), _Exited(0)], 0.01) is None


def test_a_rank_other_than_0_that_fails_alone_is_heard(tmp_path, monkeypatch, capsys):
    # moebal.cli prints bad input on rank 0 only (every rank's shared error, said once); an error only another
    # rank met (a plan only its replica could not run) was an exit code and nothing else
    from moebal.cli import main

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(spawn.ERRORS_ENV, str(tmp_path))
    assert main(["plan", "stages", "--costs", "1,x", "--stages", "1"]) == 2
    assert capsys.readouterr().err == ""  # not on the rank's own stderr: the launcher says it
    line = (tmp_path / "rank-3").read_text()
    assert line.startswith("moebal plan: error (rank 3): --costs: expected numbers"), line
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "rank-3").write_text(line)
    spawn._say_rank_error(str(kept), 3, spawn.BAD_INPUT, -signal.SIGTERM)  # rank 0 was stopped: rank 3's error
    assert capsys.readouterr().err.strip() == line.strip() and not kept.exists()
    again = tmp_path / "again"
    again.mkdir()
    (again / "rank-3").write_text(line)
    spawn._say_rank_error(str(again), 3, spawn.BAD_INPUT, spawn.BAD_INPUT)  # rank 0 printed the job's error
    assert capsys.readouterr().err == "" and not again.exists()


def test_under_torchrun_a_rank_s_error_is_its_error_file(tmp_path, monkeypatch, capsys):
    # torchrun reads a failed rank's TORCHELASTIC_ERROR_FILE into its failure summary; without one it says
    # "error_file: <N/A>", and a rank other than 0 had no line anywhere
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from moebal.cli import TORCHRUN_ERROR_ENV, main

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv(TORCHRUN_ERROR_ENV, str(tmp_path / "error.json"))
    assert main(["plan", "stages", "--costs", "1,x", "--stages", "1"]) == 2
    assert capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=2, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    line = failure.message["extraInfo"]["py_callstack"]
    assert line.startswith("moebal plan: error (rank 2): --costs: expected numbers"), line
    assert failure.timestamp > 0


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 spawn.ERRORS_ENV, "TORCHELASTIC_ERROR_FILE")


@pytest.mark.parametrize("env,named", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"),
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x' must be an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "RANK=3 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "notaport"}, "MASTER_PORT='notaport'"),
], ids=["world-abc", "local-world-x", "world-0", "rank-3-of-2", "no-master-addr", "bad-port"])
def test_a_bad_torchrun_environment_is_one_line_naming_the_variable(monkeypatch, capsys, env, named):
    """A rank started by hand (`moebal train` under a torchrun environment set by hand): a variable that is not an
    integer, out of range, or a missing rendezvous is one line on stderr naming it, before anything starts (it was
    a traceback, a hang in the rendezvous, or for WORLD_SIZE=0 a silent one-process run)."""
    from moebal.cli import main
    from moebal.distributed.groups import check_env_world

    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    check_env_world()  # no torchrun environment: one process
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=named):
        check_env_world()
    assert main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_rank_with_no_rank_number_says_why_it_stopped(monkeypatch, capsys):
    """RANK=x: no rank 0 reports the bad input, so this rank does (its stderr was empty)."""
    from moebal.cli import main

    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--steps", "1"]) == 2
    assert "RANK='x' must be an integer" in capsys.readouterr().err
