"""Run a function on several real gloo ranks (for tests and small benchmarks).

The function must be importable by reference (a module-level function). Each rank runs it as
`fn(rank, world_size, *args)`; results come back in rank order, pickled by value (tensors copied, not shared
through memory the rank's exit would release). A failing rank makes the whole call raise with that rank's
traceback; the others are stopped instead of waiting in a collective.

Start-up: every rank is a new process, forked by multiprocessing's forkserver, which imported torch, numpy and
the moebal modules once (`_preload`), so a call does not pay a torch import per rank (3 s a rank on a 2-core
machine). Each rank is still a fresh process: nothing a rank does reaches the next call, and what a fork
would share is reset as the rank starts (the caller's environment, working directory, stdout and stderr rather
than the forkserver's; numpy's global RNG reseeded as a new process would be). Python's `random` reseeds itself on
fork; torch's default generator holds its import-time seed, as in a spawned process. Set MOEBAL_RUN_RANKS_START=spawn to
start every rank as a new interpreter instead (debugging: no state shared with a long-lived server at all).
Environment variables that torch reads at import time (OMP_NUM_THREADS, ...) are those of the first call:
the forkserver imported torch then.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from moebal.launch.forkserver import RANK_RUNTIME_PRELOAD, CallerFd, ensure_forkserver, fresh_process
from moebal.launch.spawn import rank_name, rendezvous_store
from moebal.planner.plan import ExpertPlacement, default_owners

__all__ = ["START_METHOD_ENV", "kill_rank_when", "random_placements", "rank_pid", "run_ranks"]

START_METHOD_ENV = "MOEBAL_RUN_RANKS_START"  # "forkserver" (the default) or "spawn"
_START_METHODS = ("forkserver", "spawn")


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], q: Any,
           threads: int, env: dict[str, str], cwd: str, fds: tuple[Any, ...]) -> None:
    del fds  # adopted while unpickling (CallerFd)
    fresh_process(env, cwd)  # a forked rank starts with the forkserver's environment and working directory
    # the caller hosts the store (`run_ranks`); rank 0 connects to it as a client, as under the launcher
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks asks for the stacks of a hung rank
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # by value: torch's queue would send a tensor as a handle to shared memory that the parent opens after
        # this process may have exited ("Connection reset by peer" in rebuild_storage_fd)
        q.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              threads: int = 1) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` new gloo ranks; the list of their return values."""
    ctx = _context()
    q = ctx.Queue()
    # The rendezvous store listens before any rank starts, on a port of its own choosing: a port that was free
    # a moment ago (and that rank 0 would bind once it has started) races with other jobs on the machine, a
    # parallel test worker's included (`rendezvous_store` in moebal/launch/spawn.py says how it fails). It is
    # held until the call returns.
    store = rendezvous_store(world_size)
    port = store.port
    env = dict(os.environ)
    fds = (CallerFd(1), CallerFd(2))
    # Not daemonic: a rank may start processes of its own (background micro-batch planners); the finally
    # below joins or terminates every rank whatever happens.
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, q, threads, env, os.getcwd(), fds),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            rank, ok, value = _next_report(q, procs, results, timeout_s)
            if not ok:
                raise RuntimeError(_failures(q, rank, value))
            results[rank] = pickle.loads(value)
    finally:
        # Ranks that reported may still be closing their process group: 5 s in all to exit. After a failure
        # or a timeout the others are stopped at once (their stacks, if hung, are on stderr already).
        _stop(procs, grace_s=5.0 if len(results) == world_size else 0.0)
    return [results[r] for r in range(world_size)]


def _next_report(q: Any, procs: list[Any], results: dict[int, Any], timeout_s: float) -> tuple[int, bool, Any]:
    """The next rank's (rank, ok, value), waiting up to `timeout_s` for it. A rank that exits without reporting
    (killed, a crash in C code, `os._exit`, a function the rank could not unpickle) fails the call within about
    a second and a half of its exit, not at the timeout; a hang fails at the timeout with every live rank's
    stacks on stderr."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            report: tuple[int, bool, Any] = q.get(timeout=max(0.01, min(_POLL_S, deadline - time.monotonic())))
            return report
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
        if dead:
            try:  # its report may still be on its way through the queue's pipe
                report = q.get(timeout=_LAST_WORDS_S)
                return report
            except queue.Empty:
                codes = ", ".join(f"rank {r}: {_exit_words(procs[r].exitcode)}" for r in dead)
                raise RuntimeError(f"ranks {dead} exited without reporting a result ({codes}): a crash below "
                                   f"Python, a kill, os._exit, or a function the rank could not import by "
                                   f"reference (a module-level function of an importable module)") from None
        if time.monotonic() >= deadline:
            _dump_stacks(procs)
            raise RuntimeError(f"ranks {sorted(set(range(len(procs))) - set(results))} gave no result within "
                               f"{timeout_s:.0f}s; the stacks of those still running are on stderr above")


_POLL_S = 1.0
"""How often a wait for reports looks for ranks that exited without one."""
_LAST_WORDS_S = 0.5
"""How long an exited rank's report may still take to come out of the queue."""


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join every rank within `grace_s` seconds in all; terminate (SIGTERM) and join those still running."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(end - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join()


def _context() -> Any:
    """The multiprocessing context that starts the ranks (module docstring: forkserver unless
    MOEBAL_RUN_RANKS_START=spawn), its forkserver running."""
    method = os.environ.get(START_METHOD_ENV, "") or "forkserver"
    if method not in _START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r} is not a start method run_ranks knows; use one of "
                         f"{', '.join(_START_METHODS)} (or unset it: forkserver)")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ensure_forkserver(ctx, _preload())
    return ctx


def _preload() -> list[str]:
    """What the forkserver imports once for every rank it forks: torch (with torch.distributed), numpy, what a
    training rank imports lazily (RANK_RUNTIME_PRELOAD: torch._dynamo, FSDP2, ...), and the moebal modules
    the caller has imported (under pytest: every module the collected tests import), plus pytest when the caller
    runs under it (test modules import it). Importing only: the server runs no torch op, so no thread pool exists
    to be broken by a fork."""
    mine = sorted(m for m in sys.modules if m.split(".")[0] in ("moebal", "pytest") and not m.endswith("__main__"))
    return ["torch", "torch.distributed", "numpy", *RANK_RUNTIME_PRELOAD, *mine]


def _dump_stacks(procs: list[Any], wait_s: float = 2.0) -> None:
    """Have every live rank print all its threads' stacks to stderr (faulthandler on SIGUSR1, see _entry)."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(wait_s)


def _failures(q: Any, rank: int, value: str, grace_s: float = 5.0) -> str:
    """Every rank's failure that arrives within `grace_s` of the first. The first report is often not the cause:
    a rank whose peer died reports the broken connection, and the peer's own traceback may still be in its
    queue's feeder thread. A failure that is not a broken connection is listed first."""
    failed = {rank: value}
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            r, ok, v = q.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if not ok:
            failed[r] = v
    broken = ("Connection reset", "Connection closed", "Broken pipe")
    order = sorted(failed, key=lambda r: (any(b in failed[r] for b in broken), r))
    return "\n".join(f"rank {r} failed:\n{failed[r]}" for r in order)


def rank_pid(rank: int, marker: str) -> int | None:
    """The process of training rank `rank` in the job whose environment holds `marker` (NAME=value), found in
    /proc (Linux): it works across network namespaces and launchers, wherever the rank was started. A rank that
    `moebal train --nproc N` forked from its forkserver (moebal.launch.spawn) shows the server's environment and
    command line in /proc, so it is known by the name it gives itself (`rank_name`, /proc/PID/comm); one that
    was started as a new process (torchrun, MOEBAL_RANK_START=exec), by RANK in its environment."""
    want = {marker.encode(), f"RANK={rank}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            cmd = (entry / "cmdline").read_bytes()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        started = want <= env and b"moebal.cli" in cmd and b"torch.distributed.run" not in cmd
        forked = marker.encode() in env and comm == rank_name(rank)
        if started or forked:
            found.append(int(entry.name))
    return max(found) if found else None  # the newest, should an earlier attempt's process still be exiting


def kill_rank_when(ready: Callable[[], bool], rank: int, marker: str, timeout_s: float = 300.0,
                   poll_s: float = 0.05, alive: Callable[[], bool] = lambda: True) -> float:
    """SIGKILL rank `rank` of the marked job as soon as `ready()` (e.g. a checkpoint exists); the time of the kill
    (time.time()). Raises TimeoutError when `ready()` or the rank did not show up in time, or `alive()` turned
    false (the job ended) first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"rank {rank} of {marker} was not ready to be killed "
                               f"({'timed out' if alive() else 'the job ended'})")
        pid = rank_pid(rank, marker) if ready() else None
        if pid is not None:
            t = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return t
        time.sleep(poll_s)


def random_placements(E: int, R: int, step: int, layers: int) -> list[ExpertPlacement]:
    """Per layer, every expert replicated on each other rank with probability 1/2: the same draw on every rank
    (seeded by `step`), so tests exercise Trans/Agg without a planner."""
    owner = default_owners(E, R)
    rng = random.Random(1000 * step + 7)
    out = []
    for _ in range(layers):
        reps = tuple(tuple(sorted(r for r in range(R) if r != owner[e] and rng.random() < 0.5)) for e in range(E))
        out.append(ExpertPlacement(num_ranks=R, owner=owner, replicas=reps, policy="random"))
    return out
