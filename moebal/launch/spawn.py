"""Starting and watching processes: the ranks of `moebal train --nproc N`, and the nodes of `moebal launch`.

`spawn_local` runs N ranks on this machine, each a fresh `python -m moebal.cli ...` process with the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same code path
runs under plain torchrun. Like torchrun's agent, the launcher hosts the job's c10d store itself (a new one per
attempt), listening before any rank starts, and the ranks connect to it as clients
(TORCHELASTIC_USE_AGENT_STORE): see `_rendezvous_store` for the race this closes. When a rank fails it stops the
others at once instead of letting them hang in a collective, reports which rank failed and, with `max_restarts`,
starts every rank again (with TORCHELASTIC_RESTART_COUNT set as torchrun would, and `restart_argv`:
`--auto-resume` makes `moebal train` continue from the run's last checkpoint).
Exit code 2 (bad input: config, data, checkpoint) is not restarted, since it would fail the same way.

Stopping: SIGTERM and SIGHUP (what a job scheduler or a closed terminal sends) stop a launcher the way Ctrl-C
does: it stops its ranks or nodes (SIGTERM, SIGKILL after a grace period), waits for them, and only then
exits (128 + the signal's number). A rank of `spawn_local` also asks Linux to send it SIGTERM when its
launcher dies (PR_SET_PDEATHSIG), so that even a SIGKILLed launcher leaves no rank behind.

`run_nodes` runs one local command per node (an ssh, a namespace exec, ...), prefixes every line the node
prints with its name, and stops every node when one fails. Restarting ranks inside a node is torchrun's job
there; a node whose torchrun exits non-zero has run out of restarts (or lost its rendezvous).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

from moebal.errors import ConfigError

__all__ = ["Stopped", "die_with_launcher", "free_port", "local_ranks", "run_nodes", "spawn_local"]

BAD_INPUT = 2  # the exit code of a MoebalError (moebal.cli)
LAUNCHER_ENV = "MOEBAL_LAUNCHER_PID"  # in a rank of spawn_local: the launcher it must not outlive
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached a launcher; raised like Ctrl-C's KeyboardInterrupt so that the launcher stops
    its children on the way out. `signum`: the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped inside the block (the main thread only: Python runs handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def die_with_launcher() -> None:
    """In a rank of spawn_local (Linux): have the kernel send this process SIGTERM when its launcher dies, by
    whatever means, so that no rank keeps training, orphaned, beside a job that reuses its run directory."""
    pid = os.environ.pop(LAUNCHER_ENV, None)  # popped: processes this rank starts have their own parent
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != int(pid):  # the launcher died before the request: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def local_ranks(nproc: int | None, gpus: int) -> int:
    """Ranks `moebal train` runs on this machine: `parallel.nproc`, or when null one per visible GPU (`gpus` > 0:
    a CUDA run), 2 on a CPU. On CUDA more ranks than GPUs is a ConfigError (NCCL needs a GPU per rank)."""
    from moebal.distributed.groups import check_ranks_fit

    if gpus <= 0:
        return 2 if nproc is None else nproc
    n = gpus if nproc is None else nproc
    check_ranks_fit(n, gpus)
    return n


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def spawn_local(nproc: int, argv: Sequence[str], env: dict[str, str] | None = None,
                threads_per_rank: int | None = None, poll_s: float = 0.05, max_restarts: int = 0,
                restart_argv: Sequence[str] = ()) -> int:
    """Run `python -m moebal.cli *argv` as `nproc` ranks; return 0, or the failing rank's exit code once
    `max_restarts` restarts of the whole job are used up. Restarts run `*argv, *restart_argv`."""
    base = {**os.environ, **(env or {}), LAUNCHER_ENV: str(os.getpid())}
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nproc)
    with _stopped_by_signals():
        return _attempts(nproc, argv, base, threads_per_rank, poll_s, max_restarts, restart_argv)


def _attempts(nproc: int, argv: Sequence[str], base: dict[str, str], threads_per_rank: int, poll_s: float,
              max_restarts: int, restart_argv: Sequence[str]) -> int:
    for attempt in range(max_restarts + 1):
        store = _rendezvous_store(nproc)  # held until this attempt's ranks are gone
        port = store.port
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(nproc):
                rank_env = {**base, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "OMP_NUM_THREADS": str(threads_per_rank), "TORCHELASTIC_RESTART_COUNT": str(attempt),
                            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                extra = list(restart_argv) if attempt else []
                procs.append(subprocess.Popen([sys.executable, "-m", "moebal.cli", *argv, *extra], env=rank_env))
            failed = _watch(procs, poll_s)
        except BaseException:  # Ctrl-C, SIGTERM (Stopped), ...: no rank outlives the launcher
            _stop_undisturbed(procs)
            raise
        if failed is None:
            return 0
        rank, code = failed
        _stop(procs)
        if attempt < max_restarts and code != BAD_INPUT:
            print(f"moebal: rank {rank} failed ({_how(code)}); restarting every rank from the last checkpoint "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
            continue
        left = "; no restarts left" if max_restarts and code != BAD_INPUT else ""
        print(f"moebal: rank {rank} failed ({_how(code)}); stopped the other ranks{left}", file=sys.stderr)
        return code if code > 0 else 1
    raise AssertionError("unreachable")


def _rendezvous_store(world_size: int) -> Any:
    """A c10d TCPStore for one attempt of the job, listening on a port of its own choosing before any rank starts.

    Handing the ranks a port that was free a moment ago (`free_port`) and letting rank 0 bind it races under
    load: until rank 0, still importing torch, listens, the other ranks retry their connects, and the kernel may
    give such a connect that very port as its own local port (the port is in the ephemeral range), so the
    client connects to itself (a TCP simultaneous open) and waits for its own replies while rank 0 waits for
    it: the ranks stay alive and idle, which is how a restarted job of the restart test hung for 600 s under a
    full-suite load. A port with a listener is never handed out for a connect, and the ranks find it listening.
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=300))


def _watch(procs: Sequence[subprocess.Popen[bytes]], poll_s: float) -> tuple[int, int] | None:
    """Wait until every process exited 0 (None) or one failed: (its index, its exit code)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(poll_s)


def _stop_undisturbed(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """`_stop` with SIGINT, SIGTERM and SIGHUP held back until it is done (a second Ctrl-C, or the scheduler's
    next SIGTERM, must not cut it short and leave children running); they are delivered afterwards."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        _stop(procs, grace_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM every process still running, SIGKILL (its whole process group when it leads one) after
    `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except ProcessLookupError:
                pass
            p.wait()


# --------------------------------------------------------------------------------------------
# nodes


def _pump(stream: IO[bytes], prefix: str, sink: IO[str], lock: threading.Lock) -> None:
    """Copy a node's output to ours line by line, each line prefixed (a terminal's \\r\\n made \\n)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            sink.write(f"{prefix}{line}\n")
            sink.flush()
    stream.close()


def run_nodes(nodes: Sequence[tuple[str, Sequence[str]]], grace_s: float = 15.0, poll_s: float = 0.1,
              stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run one command per node (name, argv; no shell) until all exit 0 (return 0) or one fails: then stop
    the others (SIGTERM, SIGKILL after `grace_s`) and return the failed node's exit code."""
    with _stopped_by_signals():
        return _run_nodes(nodes, grace_s, poll_s, stdout or sys.stdout, stderr or sys.stderr)


def _run_nodes(nodes: Sequence[tuple[str, Sequence[str]]], grace_s: float, poll_s: float, out: IO[str],
               err: IO[str]) -> int:
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for name, argv in nodes:
            try:
                # a session of its own: a Ctrl-C reaches the launcher, which stops the nodes in order
                p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:
                raise ConfigError(f"cannot start node {name}: {argv[0]!r}: {e.strerror or e}; check the launcher "
                                  f"command (ssh.command) and that the program is installed here") from None
            procs.append(p)
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                assert stream is not None
                t = threading.Thread(target=_pump, args=(stream, f"[{name}] ", sink, lock), daemon=True)
                t.start()
                pumps.append(t)
        failed = _watch(procs, poll_s)
    except BaseException:  # Ctrl-C, SIGTERM (Stopped), ...: no node outlives the launcher
        _stop_undisturbed(procs, grace_s)
        raise
    if failed is not None:
        i, code = failed
        _stop(procs, grace_s)
    for t in pumps:
        t.join(timeout=5.0)
    if failed is None:
        return 0
    with lock:
        err.write(f"moebal launch: node {nodes[i][0]} failed ({_how(code)}); stopped the other nodes\n")
        err.flush()
    return code if code > 0 else 1
