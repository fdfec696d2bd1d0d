"""Starting and watching processes: the ranks of `moebal train --nproc N`, and the nodes of `moebal launch`.

`spawn_local` runs N ranks on this machine, each running `moebal.cli` with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the same code path runs under plain
torchrun. Each rank is a new process forked from a forkserver that the launcher starts once and that imported
torch and the training modules (moebal.launch.forkserver), so N ranks pay one torch import, not N (3-4 s of CPU
each); the rank takes the launcher's environment and working directory, and names itself `moebal-rankN` (what
`ps` and /proc/PID/comm show; its /proc environment and command line are the forkserver's). Set
MOEBAL_RANK_START=exec to start every rank as a fresh `python -m moebal.cli ...` interpreter instead (debugging:
no state shared with the forkserver at all).

Like torchrun's agent, the launcher hosts the job's c10d store itself (a new one per attempt), listening before any
rank starts, and the ranks connect to it as clients (TORCHELASTIC_USE_AGENT_STORE): see `rendezvous_store` for the
race this closes. When a rank fails it stops the others at once instead of letting them hang in a collective,
reports which rank failed and, with `max_restarts`, starts every rank again (with TORCHELASTIC_RESTART_COUNT set as
torchrun would, and `restart_argv`: `--auto-resume` makes `moebal train` continue from the run's last checkpoint).
Exit code 2 (bad input: config, data, checkpoint) is not restarted, since it would fail the same way.

Stopping: SIGTERM and SIGHUP (what a job scheduler or a closed terminal sends) stop a launcher the way Ctrl-C
does: it stops its ranks or nodes (SIGTERM, SIGKILL after a grace period), waits for them, and only then
exits (128 + the signal's number). A rank of `spawn_local` also asks Linux to send it SIGTERM when its
launcher dies (PR_SET_PDEATHSIG), so that even a SIGKILLed launcher leaves no rank behind: a forked rank, when its
forkserver dies, which exits as soon as its launcher is gone.

`run_nodes` runs one local command per node (an ssh, a namespace exec, ...), prefixes every line the node
prints with its name, and stops every node when one fails. Restarting ranks inside a node is torchrun's job
there; a node whose torchrun exits non-zero has run out of restarts (or lost its rendezvous).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from moebal.errors import ConfigError

__all__ = ["JOB_START_ENV", "RANK_START_ENV", "Stopped", "die_with_launcher", "free_port", "job_age_s",
           "job_start_env", "local_ranks", "rank_name", "rendezvous_store", "run_nodes", "spawn_local",
           "start_rank_server"]

BAD_INPUT = 2  # the exit code of a MoebalError (moebal.cli)
LAUNCHER_ENV = "MOEBAL_LAUNCHER_PID"  # in a rank of spawn_local: its parent (launcher or forkserver), not outlived
ERRORS_ENV = "MOEBAL_RANK_ERRORS"
"""In a rank of spawn_local: a directory where a rank other than 0 leaves its one-line error (moebal.cli prints
only rank 0's, which every rank's shared bad input gives alike), for the launcher to say when that rank failed
alone."""
JOB_START_ENV = "MOEBAL_JOB_START"
"""The job's start (Unix time in seconds), which a launcher gives every rank of every attempt (`moebal train
--nproc N`, `moebal launch`, its Slurm script): `train.time_limit_min` counts from it, so that a restart after a
failure does not start the limit again (`job_age_s`)."""
RANK_START_ENV = "MOEBAL_RANK_START"  # how spawn_local starts a rank: "forkserver" (the default) or "exec"
_RANK_STARTS = ("forkserver", "exec")
# what the forkserver imports for every rank (beside the moebal modules the launcher imported)
# (not moebal.cli: a rank's multiprocessing runs the launcher's main module, moebal.cli, as __mp_main__, and
# runpy warns when it was imported already)
_RANK_PRELOAD = ("torch", "torch.distributed", "numpy", "moebal.commands.train", "moebal.data", "moebal.train.trainer")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGINT (Ctrl-C), SIGTERM or SIGHUP reached a launcher; a KeyboardInterrupt, so that the launcher stops its
    children on the way out and `moebal` exits with 128 + `signum`, the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Stop signals noted by `_stopped_by_signals`' handler and not yet acted on (main thread only).
_pending: list[int] = []


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Inside the block SIGINT, SIGTERM and SIGHUP stop the launcher: the handler only notes the signal, and the
    watch loop (`_check_stopped`) raises Stopped at a point where that is safe; the block's exit raises it too
    when a signal arrived after the last check. Main thread only: Python runs handlers there.

    The handler must not raise by itself: an exception raised between two bytecodes can land inside
    subprocess.Popen.poll after it took its wait lock and before its try block, leaving the lock held, and the
    later `wait()` that stops the child then blocks forever (a SIGTERM'd launcher hung that way)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: object) -> None:
        _pending.append(signum)

    old = {s: signal.signal(s, note) for s in _STOP_SIGNALS}
    _pending.clear()
    try:
        yield
        _check_stopped()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _pending.clear()


def _check_stopped() -> None:
    """Raise Stopped for the first stop signal noted since the block began (nothing outside the block)."""
    if _pending:
        raise Stopped(_pending[0])


def die_with_launcher() -> None:
    """In a rank of spawn_local (Linux): have the kernel send this process SIGTERM when its launcher dies, by
    whatever means, so that no rank keeps training, orphaned, beside a job that reuses its run directory. A
    forked rank watches its parent, the forkserver, which exits when the launcher is gone (MOEBAL_LAUNCHER_PID
    names the parent either way)."""
    pid = os.environ.pop(LAUNCHER_ENV, None)  # popped: processes this rank starts have their own parent
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != int(pid):  # the launcher died before the request: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def job_start_env() -> dict[str, str]:
    """`JOB_START_ENV` for the ranks of a job that starts now."""
    return {JOB_START_ENV: f"{time.time():.3f}"}


def job_age_s() -> float:
    """In a rank of a launched job (RANK set): seconds since the job's start, `JOB_START_ENV`; 0 outside one or
    where the launcher set none (plain torchrun). A start ahead of this node's clock counts as now."""
    raw = os.environ.get(JOB_START_ENV, "")
    if "RANK" not in os.environ or not raw:  # a one-process run ignores a value left in the user's shell
        return 0.0
    try:
        start = float(raw)
    except ValueError:
        start = math.nan
    if not math.isfinite(start):
        raise ConfigError(f"{JOB_START_ENV}={raw!r} is not a Unix time in seconds; moebal's launchers set it for "
                          f"their ranks: unset it")
    return max(0.0, time.time() - start)


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


def rank_name(rank: int) -> str:
    """The name a forked rank gives itself (/proc/PID/comm, what `ps` shows): at most 15 characters (Linux)."""
    return f"moebal-rank{rank}"[:15]


def _rank_start() -> str:
    """How spawn_local starts a rank (module docstring): MOEBAL_RANK_START, "forkserver" when unset."""
    how = os.environ.get(RANK_START_ENV, "") or "forkserver"
    if how not in _RANK_STARTS:
        raise ConfigError(f"{RANK_START_ENV}={how!r} is not a way to start ranks; use one of {', '.join(_RANK_STARTS)}"
                          f" (or unset it: forkserver)")
    return how


def _threads(nproc: int, threads_per_rank: int | None) -> int:
    return threads_per_rank if threads_per_rank is not None else max(1, (os.cpu_count() or 1) // nproc)


def start_rank_server(nproc: int, threads_per_rank: int | None = None) -> Any:
    """Start the forkserver that spawn_local forks ranks from (unless MOEBAL_RANK_START=exec: None), so that its
    imports run while the launcher prepares the job; returns its multiprocessing context. Started once per
    launcher process: later calls return the running one."""
    if _rank_start() != "forkserver":
        return None
    import multiprocessing

    from moebal.launch.forkserver import RANK_RUNTIME_PRELOAD, ensure_forkserver

    ctx = multiprocessing.get_context("forkserver")
    mine = sorted(m for m in sys.modules if m.split(".")[0] == "moebal" and m != "moebal.cli")
    # OMP_NUM_THREADS as a new rank's: OpenMP reads it once, when torch loads it (in the server)
    threads = {"OMP_NUM_THREADS": str(_threads(nproc, threads_per_rank))}
    ensure_forkserver(ctx, [*_RANK_PRELOAD, *RANK_RUNTIME_PRELOAD, *mine], threads)
    return ctx


def spawn_local(nproc: int, argv: Sequence[str], env: dict[str, str] | None = None,
                threads_per_rank: int | None = None, poll_s: float = 0.05, max_restarts: int = 0,
                restart_argv: Sequence[str] = ()) -> int:
    """Run `moebal.cli *argv` as `nproc` ranks; return 0, or the failing rank's exit code once `max_restarts`
    restarts of the whole job are used up. Restarts run `*argv, *restart_argv`."""
    base = {**os.environ, **job_start_env(), **(env or {}), LAUNCHER_ENV: str(os.getpid())}
    threads_per_rank = _threads(nproc, threads_per_rank)
    with _stopped_by_signals():
        ctx = start_rank_server(nproc, threads_per_rank)
        start = _exec_rank if ctx is None else _forker(ctx)
        return _attempts(nproc, argv, base, threads_per_rank, poll_s, max_restarts, restart_argv, start)


class _Child(Protocol):
    """A started rank or node: a subprocess.Popen, or a forked rank (_Forked)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Forked:
    """A rank forked by the forkserver (a multiprocessing.Process), seen through subprocess.Popen's methods."""

    def __init__(self, process: Any) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def poll(self) -> int | None:
        code = self.process.exitcode
        return None if code is None else int(code)

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


StartRank = Callable[[Sequence[str], dict[str, str]], _Child]


def _exec_rank(argv: Sequence[str], env: dict[str, str]) -> _Child:
    """A rank as a fresh interpreter (MOEBAL_RANK_START=exec)."""
    return subprocess.Popen([sys.executable, "-m", "moebal.cli", *argv], env=env)


def _forker(ctx: Any) -> StartRank:
    """Start a rank by forking it from the running forkserver of `ctx`."""
    from moebal.launch.forkserver import CallerFd, forkserver_pid

    def start(argv: Sequence[str], env: dict[str, str]) -> _Child:
        server = forkserver_pid()
        if server is None:
            raise RuntimeError("the rank forkserver is not running")
        env = {**env, LAUNCHER_ENV: str(server)}  # the rank's parent: the server, which dies with the launcher
        # Not daemonic: a rank starts processes of its own (background micro-batch planners)
        p = ctx.Process(target=_forked_rank, args=(list(argv), env, os.getcwd(), (CallerFd(1), CallerFd(2))),
                        daemon=False, name=rank_name(int(env["RANK"])))
        p.start()
        return _Forked(p)

    return start


def _forked_rank(argv: list[str], env: dict[str, str], cwd: str, fds: tuple[Any, ...]) -> None:
    """A forked rank's body: become what `python -m moebal.cli *argv` would be in the launcher's environment, run
    it, and exit with its code (Python's atexit handlers run, as at a new process's exit)."""
    import atexit
    import threading
    import traceback

    from moebal.launch.forkserver import fresh_process

    del fds  # adopted while unpickling (CallerFd)
    fresh_process(env, cwd)
    _name_this_process(rank_name(int(env["RANK"])))
    import torch

    if torch.cuda._is_in_bad_fork():  # the server imports only, so CUDA is not initialized there; say so if it was
        raise RuntimeError(f"CUDA was initialized in the rank forkserver, so a forked rank cannot use it; set "
                           f"{RANK_START_ENV}=exec (and report which import initialized it)")
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from moebal import cli

    sys.argv = [str(cli.__file__), *argv]
    try:
        code = cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does in a new process: traceback, exit 1
        traceback.print_exc()
        code = 1
    # The interpreter's own exit order: first threading's shutdown (it joins non-daemon threads and runs the
    # threading atexits, where a ProcessPoolExecutor tells its workers to stop), then the atexit handlers
    # (multiprocessing's joins every non-daemon child). The other order joins pool workers that were never told
    # to stop: the rank hangs at its exit (seen with DynaPipe's planning workers).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.exit(code)


def _name_this_process(name: str) -> None:
    """Set /proc/PID/comm (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def _attempts(nproc: int, argv: Sequence[str], base: dict[str, str], threads_per_rank: int, poll_s: float,
              max_restarts: int, restart_argv: Sequence[str], start: StartRank) -> int:
    for attempt in range(max_restarts + 1):
        _check_stopped()  # a signal during the start or the last attempt's stop: no new attempt
        store = rendezvous_store(nproc)  # held until this attempt's ranks are gone
        port = store.port
        procs: list[_Child] = []
        errors = tempfile.mkdtemp(prefix="moebal-rank-errors-")
        try:
            for rank in range(nproc):
                rank_env = {**base, ERRORS_ENV: errors, "RANK": str(rank), "WORLD_SIZE": str(nproc),
                            "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "OMP_NUM_THREADS": str(threads_per_rank), "TORCHELASTIC_RESTART_COUNT": str(attempt),
                            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                extra = list(restart_argv) if attempt else []
                procs.append(start([*argv, *extra], rank_env))
            failed = _watch(procs, poll_s)
        except BaseException:  # Ctrl-C, SIGTERM (Stopped), ...: no rank outlives the launcher
            _stop_undisturbed(procs)
            shutil.rmtree(errors, ignore_errors=True)
            raise
        if failed is None:
            shutil.rmtree(errors, ignore_errors=True)
            return 0
        rank, code = failed
        _stop(procs)
        _say_rank_error(errors, rank, code, procs[0].poll())
        if attempt < max_restarts and code != BAD_INPUT:
            print(f"moebal: rank {rank} failed ({_how(code)}); restarting every rank from the last checkpoint "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
            continue
        left = "; no restarts left" if max_restarts and code != BAD_INPUT else ""
        print(f"moebal: rank {rank} failed ({_how(code)}); stopped the other ranks{left}", file=sys.stderr)
        return code if code > 0 else 1
    raise AssertionError("unreachable")


def _say_rank_error(errors: str, rank: int, code: int, rank0_code: int | None) -> None:
    """Print the one-line error a failed rank other than 0 left (`ERRORS_ENV`), unless rank 0 failed on bad
    input too (then it printed the job's error itself); remove the directory."""
    try:
        if rank != 0 and code == BAD_INPUT and rank0_code != BAD_INPUT:
            with contextlib.suppress(OSError):
                line = Path(errors, f"rank-{rank}").read_text(encoding="utf-8").strip()
                if line:
                    print(line, file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def rendezvous_store(world_size: int) -> Any:
    """A c10d TCPStore for one attempt of a job (the launcher's, `run_ranks`'s), listening on a port of its own
    choosing before any rank starts; the ranks connect as clients (TORCHELASTIC_USE_AGENT_STORE).

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


def _watch(procs: Sequence[_Child], poll_s: float) -> tuple[int, int] | None:
    """Wait until every process exited 0 (None) or one failed: (its index, its exit code).

    Several may be seen failed in one poll: a rank SIGKILLed (by the OOM killer, a scheduler, a test) takes its
    peers down within milliseconds, each with an error of its own (a closed connection), and the first of
    them by index is not the cause. The one a signal ended is named (the lowest such index), else the lowest
    index: a peer's loss never ends a rank by a signal."""
    while True:
        _check_stopped()
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return min(failed, key=lambda f: (f[1] > 0, f[0]))
        if all(c == 0 for c in codes):
            return None
        time.sleep(poll_s)


def _stop_undisturbed(procs: Sequence[_Child], grace_s: float = 5.0) -> None:
    """`_stop` with SIGINT, SIGTERM and SIGHUP held back until it is done (a second Ctrl-C, or the scheduler's
    next SIGTERM, must not cut it short and leave children running); they are delivered afterwards."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        _stop(procs, grace_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop(procs: Sequence[_Child], grace_s: float = 5.0) -> None:
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
    procs: list[_Child] = []
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
