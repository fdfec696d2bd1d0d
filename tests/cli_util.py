"""`moebal ...` run inside the test process, for integration tests that are not about the process boundary.

A test that starts `python -m moebal.cli ...` as a subprocess pays a new interpreter importing torch (3 s of CPU),
and with `--nproc N` a new rank forkserver importing torch and the training modules again (6 s). `run_cli` calls
`moebal.cli.main(argv)` in this process instead: it reuses this process's imports and, for `--nproc N`, its rank
forkserver (the one `run_ranks` uses too; started once per process). It returns what a subprocess would have
given: the exit code, and stdout and stderr as written to file descriptors 1 and 2 (so the output of forked ranks,
which write to the descriptors they were handed, is included, in the order it was written).

What a run could leave behind for later tests is restored afterwards, and what a new process would start with is
set before: the working directory (the repository root, as the subprocess helpers used) and the environment
(`env` is added for the call only), torch's intra-op threads and default dtype, the global RNGs of random, numpy
and torch, the handlers of the stop signals, warning filters, and the corpus cache (empty before and after, as in a
new process). A run that leaves a torch.distributed process group or a thread running fails the test, since a new
process would have taken them with it when it exited (moebal.kernels.workers' expert thread pool excepted: a
process-wide execution resource, like torch's own thread pools). An exception that escapes `main` is printed to
the captured stderr with exit code 1, as an uncaught exception in a new process would be; argparse's SystemExit
gives its code.

Tests of the process boundary itself (signals, a killed rank, the real exit of a process, `MOEBAL_RANK_START`,
the launcher's restarts after a rank died, `moebal launch`) keep starting real processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import random
import signal
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)

__all__ = ["ROOT", "Ran", "run_cli"]


@dataclass
class Ran:
    """What a run of `moebal` gave back (the fields of subprocess.CompletedProcess that tests read)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module, registered in sys.modules under `name` (a dataclass looks its module up
    there while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_cli(*args: str, env: Mapping[str, str] | None = None, cwd: Path | str = ROOT) -> Ran:
    """`moebal *args` in this process with `env` added to the environment and `cwd` as working directory."""
    from moebal.cli import main

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _fresh_state(env, cwd), _captured(out.fileno(), err.fileno()):
            code = _main_code(main, list(args))
        return Ran(list(args), code, _read(out), _read(err))


def _main_code(main: object, argv: list[str]) -> int:
    assert callable(main)
    try:
        return int(main(argv))
    except SystemExit as e:  # argparse (usage errors, --help)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001 - what a new process does with an uncaught exception: traceback, exit 1
        traceback.print_exc()
        return 1


def _read(f: object) -> str:
    assert isinstance(f, io.BufferedRandom)
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def _captured(out_fd: int, err_fd: int) -> Iterator[None]:
    """Descriptors 1 and 2 (and sys.stdout, sys.stderr over them) point at `out_fd` and `err_fd` inside."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved = sys.stdout, sys.stderr
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    # unbuffered text over the descriptors: in order with what forked ranks write to them
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                               errors="backslashreplace", write_through=True) for fd in (1, 2))
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
        for fd, copy in zip((1, 2), saved_fds):
            os.dup2(copy, fd)
            os.close(copy)


@contextlib.contextmanager
def _fresh_state(env: Mapping[str, str] | None, cwd: Path | str) -> Iterator[None]:
    from moebal.data import corpus

    environ, where = dict(os.environ), os.getcwd()
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    before = set(threading.enumerate())
    corpus._load_cached.cache_clear()
    os.environ.update(env or {})
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            yield
        _refuse_leftovers(before)
    finally:
        corpus._load_cached.cache_clear()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(where)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])
        for s, h in handlers.items():
            signal.signal(s, h)


def _refuse_leftovers(before: set[threading.Thread]) -> None:
    """What a new process would have taken with it at its exit must not outlive an in-process run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        raise AssertionError("the in-process moebal run left a torch.distributed process group initialized")
    # (moebal.kernels.workers' pool of expert threads is a process-wide execution resource, like torch's own pools)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon
            and not t.name.startswith("moebal-expert")]
    for t in left:
        t.join(timeout=5.0)
    left = [t.name for t in left if t.is_alive()]
    assert not left, f"the in-process moebal run left threads running: {left}"
