"""`run_ranks` (moebal/distributed/testing.py): ranks forked by a forkserver behave like freshly spawned ones.

Each rank sees the caller's environment, working directory and modules (not the forkserver's, frozen at the
first call), starts with a fresh numpy RNG, may start processes of its own, and leaves nothing behind for the
next call; a failing rank raises with its traceback and a hung one fails the call with its stack.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moebal
from moebal.distributed.testing import START_METHOD_ENV, run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


def _state(rank: int, world: int, key: str) -> dict[str, Any]:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return dict(sum=float(t), env=os.environ.get(key), cwd=os.getcwd(), moebal=moebal.__file__,
                np_draw=int(np.random.randint(0, 2**31)), dtype=str(torch.get_default_dtype()),
                grad=torch.is_grad_enabled(), deterministic=torch.are_deterministic_algorithms_enabled(),
                torch_draw=float(torch.rand(1)), threads=torch.get_num_threads(), leaked=os.environ.get("W1_LEAK"))


def _pollute(rank: int, world: int) -> None:
    """Changes every piece of process state a later call could inherit, were ranks reused."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    # the flag torch.use_deterministic_algorithms sets, without the 800 modules (torch._inductor, sympy) that
    # call imports first: 3 s of CPU per rank
    torch._C._set_deterministic_algorithms(True)
    torch.manual_seed(1234 + rank)
    os.environ["W1_LEAK"] = "yes"


def test_ranks_see_the_callers_state_now_not_the_forkservers(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks(_state, 2, "W1_KEY")  # the forkserver (if it is the start method) is running from here on
    monkeypatch.setenv("W1_KEY", "set after the first call")
    monkeypatch.chdir(tmp_path)
    out = run_ranks(_state, 2, "W1_KEY", threads=2)
    assert [o["sum"] for o in out] == [3.0, 3.0]
    assert all(o["env"] == "set after the first call" for o in out)
    assert all(o["cwd"] == str(tmp_path) for o in out)
    assert all(o["moebal"] == moebal.__file__ for o in out)  # the same copy of the package as the caller's
    assert all(o["threads"] == 2 for o in out)


def test_the_ranks_meet_on_a_port_the_call_holds_not_one_found_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port found free and bound by rank 0 later can be taken in between by another job on the machine (a second
    test worker's ranks: EADDRINUSE in rank 0). Here every port `free_port` hands out is taken already; the call
    hosts its store on a port of its own and runs."""
    import socket

    import moebal.distributed.testing as testing
    import moebal.launch.spawn as spawn

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(spawn, "free_port", lambda: port)
        monkeypatch.setattr(testing, "free_port", lambda: port, raising=False)
        assert [r["sum"] for r in run_ranks(_state, 2, "HOME", timeout_s=60.0)] == [3.0, 3.0]


def test_no_state_leaks_from_one_call_into_the_next() -> None:
    fresh = run_ranks(_state, 2, "W1_KEY")
    run_ranks(_pollute, 2)
    again = run_ranks(_state, 2, "W1_KEY")
    for a, b in zip(fresh, again):
        assert (b["dtype"], b["grad"], b["deterministic"], b["leaked"]) == ("torch.float32", True, False, None)
        assert b["torch_draw"] == a["torch_draw"]  # torch's import-time seed, as in a new process
    draws = [o["np_draw"] for o in fresh + again]
    assert len(set(draws)) == len(draws)  # numpy's global RNG is reseeded per rank, as in a new process


def _start_a_process(rank: int, world: int) -> int:
    # Like the background micro-batch planners: a spawned pool; a daemonic rank could not have children.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return int(pool.apply(pow, (rank + 3, 2)))  # a builtin: the child imports no test module (no torch)


def test_a_rank_may_start_processes_of_its_own() -> None:
    assert run_ranks(_start_a_process, 2) == [9, 16]


def _fail_on_one(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one's own failure")
    dist.barrier()


def test_a_failing_rank_raises_with_its_traceback() -> None:
    with pytest.raises(RuntimeError) as err:
        run_ranks(_fail_on_one, 2, timeout_s=60)
    text = str(err.value)
    assert "rank 1 failed" in text and "ValueError: rank one's own failure" in text
    assert text.index("rank 1 failed") == text.find("rank ")  # the cause first


def _exit_on_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no report, no traceback: as a crash below Python or a kill
    time.sleep(60)


def test_a_rank_that_exits_without_a_report_fails_the_call_at_once() -> None:
    """Not at the timeout: the call notices the exited rank within seconds and names its exit code."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited without reporting a result \(rank 1: exit code 3\)"):
        run_ranks(_exit_on_one, 2, timeout_s=120)
    assert time.monotonic() - t0 < 30


def _hang(rank: int, world: int) -> None:
    import time

    time.sleep(3600)


def test_a_hung_call_fails_with_the_ranks_stacks(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] gave no result within 2s"):
        run_ranks(_hang, 2, timeout_s=2)
    assert "_hang" in capfd.readouterr().err  # faulthandler's dump of the hung ranks' stacks


def test_spawn_stays_selectable_and_a_bad_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert [o["sum"] for o in run_ranks(_state, 2, "W1_KEY")] == [3.0, 3.0]
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='fork'.*forkserver, spawn"):
        run_ranks(_state, 2, "W1_KEY")


def test_the_forkserver_imports_with_the_callers_path() -> None:
    from moebal.distributed.testing import _preload

    names = _preload()
    assert names[:3] == ["torch", "torch.distributed", "numpy"]
    assert "moebal.distributed.testing" in names and not any(n.endswith("__main__") for n in names)
    assert sys.modules["moebal"].__file__ == moebal.__file__


def _loaded(rank: int, world: int, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in sys.modules]


def test_a_rank_finds_what_training_imports_lazily_already_loaded() -> None:
    """torch._dynamo (AdamW pulls it in: 3 s of CPU), FSDP2, safetensors: imported once by the
    forkserver, not by every rank (spawned ranks import them themselves)."""
    from moebal.launch.forkserver import RANK_RUNTIME_PRELOAD

    if os.environ.get(START_METHOD_ENV, "forkserver") != "forkserver":
        pytest.skip(f"{START_METHOD_ENV} is set to a start method without a forkserver")
    out = run_ranks(_loaded, 2, RANK_RUNTIME_PRELOAD)
    assert out == [list(RANK_RUNTIME_PRELOAD)] * 2


def _crash_on_one(rank: int, world: int) -> None:
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a crash in C code: no Python exception, no report
    time.sleep(60)


def test_a_rank_that_crashes_below_python_prints_its_stack(capfd: pytest.CaptureFixture[str]) -> None:
    """A forked rank has faulthandler on: its Python stacks reach the caller's stderr, and the call names the
    signal, so a crash in C code leaves more than an exit code."""
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited without reporting a result \(rank 1: killed by "
                                           r"SIGSEGV\)"):
        run_ranks(_crash_on_one, 2, timeout_s=120)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "_crash_on_one" in err
