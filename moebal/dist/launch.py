"""Local multi-process launch: `moebal train --nproc N` starts N ranks itself, the way torchrun would.

Each rank is a fresh `python -m moebal.cli ...` process with the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same code path runs under plain torchrun.
The parent watches its children: when one fails, it stops the others at once instead of letting them hang
in a collective, and reports which rank failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_local(nproc: int, argv: Sequence[str], env: dict[str, str] | None = None,
                threads_per_rank: int | None = None, poll_s: float = 0.05) -> int:
    """Run `python -m moebal.cli *argv` as `nproc` ranks; return 0, or the first failing rank's exit code."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    base = {**os.environ, **(env or {})}
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": str(threads_per_rank)}
        procs.append(subprocess.Popen([sys.executable, "-m", "moebal.cli", *argv], env=rank_env))
    try:
        return _watch(procs, poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        raise


def _watch(procs: list[subprocess.Popen[bytes]], poll_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            _stop(procs)
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"moebal: rank {rank} failed ({how}); stopped the other ranks", file=sys.stderr)
            return code if code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
