"""Starting ranks from a preloaded forkserver: a process that imported torch and moebal once and forks a rank per
request, so that no rank pays a fresh interpreter and a torch import (3-4 s of CPU a rank).

Used by `moebal train --nproc N` (moebal.launch.spawn) and by the tests' `run_ranks` (moebal.distributed.testing).
The server is multiprocessing's forkserver: started as a new interpreter (single-threaded, no torch op run, so a
fork copies no thread pool), it imports the modules it is given, then forks. A forked rank starts with the
server's state, not the caller's: `fresh_process` resets what a new process would take from its caller
(environment, working directory, numpy's global RNG) and `CallerFd` hands it the caller's stdout and stderr.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from typing import Any

__all__ = ["RANK_RUNTIME_PRELOAD", "CallerFd", "ensure_forkserver", "forkserver_pid", "fresh_process"]

RANK_RUNTIME_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "safetensors.torch",
                        "moebal.train.checkpoint", "moebal.train.dashboard", "moebal.train.distributed")
"""What a training rank imports lazily on its way (besides torch and moebal's own modules): torch.optim's AdamW
imports torch._dynamo (with sympy: 3 s of CPU), FSDP2, checkpoints (safetensors). Imported once in the
forkserver, a forked rank finds them loaded. A module that is not installed is skipped (multiprocessing's
forkserver ignores an ImportError in its preload)."""


class CallerFd:
    """One of the caller's file descriptors, handed to a rank as it is now (under pytest, the current test's
    capture file): a forked rank would otherwise write to the forkserver's, those of the server's start."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank starts: DupFd sends the descriptor along (multiprocessing.reduction).
        return (_adopt_fd, (reduction.DupFd(self.fd), self.fd))


def _adopt_fd(dup: Any, target: int) -> int:
    """In a rank: make `target` (1 or 2) the caller's descriptor that `dup` carries."""
    fd = int(dup.detach())
    if fd != target:  # spawn passes it under its own number
        os.dup2(fd, target)
        os.close(fd)
    return target


def ensure_forkserver(ctx: Any, preload: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Start the forkserver of `ctx` (a "forkserver" context) unless it runs, importing `preload`, with the
    caller's sys.path (as PYTHONPATH: Python 3.11's forkserver ignores the sys.path it is handed, so a module
    could resolve to another copy, an editable install's, for one) and `env` set in its environment. Preload,
    path and env take effect at the start only; later calls reuse the server."""
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(list(preload))
    changes = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def forkserver_pid() -> int | None:
    """The running forkserver's process id (the parent of every process it forks), None when it does not run."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return int(pid) if pid is not None else None


def fresh_process(env: Mapping[str, str], cwd: str) -> None:
    """In a forked rank: take the caller's environment and working directory instead of the server's, and reseed
    numpy's global RNG (a fork copies its state; a new process draws a fresh seed). Python's `random` reseeds
    itself on fork; torch's default generator holds its import-time seed, as in a new process. A crash below
    Python (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) prints every thread's Python stack to stderr, the caller's:
    without it a rank that crashes in C code leaves only its exit code."""
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
