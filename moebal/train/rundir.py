"""One live job per run directory: `RUN/moebal.lock`, held by the job that writes the run.

The lock is an exclusive `flock` on `RUN/moebal.lock`, taken by the process that owns the job: the local
launcher of `moebal train --nproc N` (its ranks inherit the fact through `MOEBAL_RUN_LOCK` and take nothing),
rank 0 under torchrun, or the single process of a one-rank run. The kernel releases a flock when its holder
exits, however it exits (kill -9 included), so a lock can never outlive its job on a filesystem with working
locks. The file itself stays, holding the last owner's host, PID and start time: a second job is refused
with that owner named. On a filesystem without flock (some network mounts) the recorded owner decides: a
dead PID of this host is a stale lock, taken over with a note naming it; a live one refuses, and so does one
of another host (which cannot be checked from here: the message says to delete the file). See
docs/training.md, "Guarantees".
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from moebal.errors import ConfigError

__all__ = ["LOCK_ENV", "LOCK_NAME", "RunLock", "lock_run_dir"]

LOCK_NAME = "moebal.lock"
LOCK_ENV = "MOEBAL_RUN_LOCK"  # set by a launcher that holds the lock for the ranks it starts
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class RunLock:
    """A held run-directory lock; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, path: Path, handle: IO[str] | None, existed: Path | None = None) -> None:
        self.path, self._handle = path, handle
        self.held = handle is not None
        """Whether this process holds it (False in a launcher's rank, which works under the launcher's)."""
        self.existed = existed
        """When taking it created the run directory (and maybe folders above it): the nearest folder that
        existed. A job that fails before writing anything removes what it made up to there (a mistyped --out
        leaves nothing behind)."""

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the flock
            self._handle = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self.existed is not None and self.held:
            run_dir = self.path.parent
            try:
                if [p.name for p in run_dir.iterdir()] == [self.path.name]:  # nothing but the lock: undo the mkdir
                    self.path.unlink()
                    for d in (run_dir, *run_dir.parents):  # and the empty folders made for it
                        if d == self.existed or any(d.iterdir()):
                            break
                        d.rmdir()
            except OSError:
                pass  # best effort: the failure being raised is what the user needs to see
        self.release()


def _owner(path: Path) -> dict[str, Any]:
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(owner: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["time"])) if "time" in owner else "?"
    return f"PID {owner.get('pid', '?')} on host {owner.get('host', '?')} (since {since})"


def _alive_here(owner: dict[str, Any]) -> bool:
    """Whether the owner is a running process of this host (a PID of another host cannot be checked)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use(run_dir: Path, path: Path, owner: dict[str, Any]) -> ConfigError:
    return ConfigError(f"{run_dir} is in use by another job: {_describe(owner)} holds {path}; wait for it or "
                       f"stop it, or choose another --out")


def _take_over(run_dir: Path, path: Path, handle: IO[str]) -> None:
    """No flock on this filesystem: the recorded owner decides. A dead PID of this host is a stale lock (taken
    over, named on stderr); a live one, or one of another host (it cannot be checked from here), refuses."""
    owner = _owner(path)
    if not owner:
        return
    here = owner.get("host") == socket.gethostname()
    if not here or _alive_here(owner):
        handle.close()
        hint = "" if here else f"; if that job has ended, delete {path}"
        raise ConfigError(str(_in_use(run_dir, path, owner)) + hint)
    print(f"moebal: {path} is a stale lock ({_describe(owner)} is not running): taking it over", file=sys.stderr)


def lock_run_dir(run_dir: str | Path) -> RunLock:
    """Create the run directory if needed and lock it for this job; ConfigError when it cannot be created or
    another live job holds it. In a launcher's rank (`MOEBAL_RUN_LOCK` set) or a torchrun rank other than 0 it
    takes nothing."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    if os.environ.get(LOCK_ENV) == str(path.resolve()) or os.environ.get("RANK", "0") != "0":
        return RunLock(path, None)  # a launcher's rank, or a torchrun rank other than 0: rank 0 holds it
    existed = next((d for d in (run_dir, *run_dir.parents) if d.exists()), None)  # the nearest that exists
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {run_dir}: {e.strerror or e}; choose a writable "
                          f"--out") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(path)
        handle.close()
        raise _in_use(run_dir, path, owner) from None
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            handle.close()
            raise
        _take_over(run_dir, path, handle)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                             "argv": sys.argv}) + "\n")
    handle.flush()
    return RunLock(path, handle, None if existed == run_dir else existed)
