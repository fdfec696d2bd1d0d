"""Two "nodes" on one Linux machine: network namespaces joined by a veth pair, for multi-node tests and demos.

Each namespace has its own interfaces, addresses and ports, so two torchrun agents in them meet only
through the veth link, exactly as two hosts meet through a network: the rendezvous store, the process
group's store and gloo's connections all cross it. Use `ip netns exec {host} sh -c {command}` as the
launcher's command template, each node's veth address as its `addr`, and GLOO_SOCKET_IFNAME set to the
veth's name (the hostname of both namespaces is the machine's, which resolves to loopback).

Needs root and iproute2; `unavailable()` says why not when they are missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["NamespacePair", "StartupError", "mark_started", "rank_worker", "run_shaped", "sweep_stale", "unavailable"]

IFNAME = "mb0"  # the veth's name inside both namespaces


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "creating network namespaces needs root (`ip netns add`)"
    probe = f"mbprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> list[str]:
    """Delete the namespace pairs of processes that no longer exist (a test killed before its clean-up); the
    names deleted. A pair's tag ends with the id of the process that made it."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(r"^mb([a-z]*)(\d+)([ab])\b", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            name = line.split()[0]
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


@dataclass
class NamespacePair:
    """Namespaces `names[i]` with address `addrs[i]` on interface IFNAME, linked by one veth pair.
    A context manager: leaving it kills what still runs inside and deletes both namespaces. `tag` should end
    with the creating process's id (`sweep_stale` relies on it)."""

    tag: str
    subnet: int = 77

    def __post_init__(self) -> None:
        self.names = (f"mb{self.tag}a", f"mb{self.tag}b")
        self.addrs = (f"10.{self.subnet}.0.1", f"10.{self.subnet}.0.2")
        self.ifname = IFNAME

    def __enter__(self) -> NamespacePair:
        sweep_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        a, b = self.names
        for ns in self.names:
            _ip("netns", "add", ns)
        # veth ends get temporary names in the root namespace, then the same name inside each namespace
        ta, tb = f"{a}x"[-15:], f"{b}x"[-15:]
        _ip("link", "add", ta, "type", "veth", "peer", "name", tb)
        for ns, tmp, addr in ((a, ta, self.addrs[0]), (b, tb, self.addrs[1])):
            _ip("link", "set", tmp, "netns", ns)
            _ip("-n", ns, "link", "set", tmp, "name", self.ifname)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.ifname)
            _ip("-n", ns, "link", "set", self.ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill every process left in the namespaces, then delete them (the veth pair goes with them)."""
        for ns in self.names:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
        for ns in self.names:  # a veth end left in the root namespace by a failed set-up
            _ip("link", "del", f"{ns}x"[-15:], check=False)


class StartupError(RuntimeError):
    """A rank died before every rank had finished start-up (nothing was measured yet)."""


def mark_started(spec: dict[str, Any], rank: int) -> None:
    """A rank of `run_shaped` says its start-up (process groups, channels, measurements) is done."""
    if spec.get("ready_dir"):
        (Path(spec["ready_dir"]) / f"ready{rank}").touch()


def run_shaped(script: str | Path, world: int, spec: dict[str, Any], link_mbit: float, *, tag: str, subnet: int,
               port: int, attempts: int = 3) -> tuple[Any, list[str]]:
    """Run `python SCRIPT --rank-worker SPEC OUT` as `world` gloo ranks on two "nodes" (rank r in namespace r % 2)
    whose veth is shaped to `link_mbit` in each direction (a token-bucket qdisc), and return (rank 0's result,
    the start-up failures retried). SCRIPT's `--rank-worker` calls `rank_worker`, and its worker calls
    `mark_started(spec, rank)` once set up.

    gloo's connection set-up in the namespaces now and then aborts a rank (std::terminate: "terminate called
    without an active exception", after c10d's harmless warning that reverse DNS of a peer address fails: the
    namespaces have no resolver) before any step ran; a rank that dies before every rank said it started
    raises StartupError, retried in fresh namespaces up to `attempts` times (nothing was measured); a failure
    after it is a real error."""
    retried: list[str] = []
    for attempt in range(1, attempts + 1):
        try:
            return _run_once(script, world, spec, link_mbit, tag, subnet, port + attempt), retried
        except StartupError as e:
            if attempt == attempts:
                raise
            retried.append(str(e))
            print(f"{world} ranks: start-up failed (attempt {attempt} of {attempts}), retrying in fresh "
                  f"namespaces: {e}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _run_once(script: str | Path, world: int, spec: dict[str, Any], link_mbit: float, tag: str, subnet: int,
              port: int) -> Any:
    with NamespacePair(tag=tag, subnet=subnet) as pair, tempfile.TemporaryDirectory() as tmp:
        for ns in pair.names:  # each direction of the veth limited to the link rate
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", pair.ifname, "root", "tbf",
                            "rate", f"{link_mbit:g}mbit", "burst", "256kb", "latency", "100ms"], check=True)
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "ready_dir": tmp}))
        procs = []
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r // 2),
                   "MASTER_ADDR": pair.addrs[0], "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": pair.ifname}
            cmd = ["ip", "netns", "exec", pair.names[r % 2], sys.executable, str(script), "--rank-worker",
                   str(spec_path), str(out)]
            with open(Path(tmp) / f"err{r}", "w") as err:  # a file, not a pipe: nobody reads while ranks run
                procs.append(subprocess.Popen(cmd, env=env, stderr=err))
        started = lambda: all((Path(tmp) / f"ready{r}").exists() for r in range(world))  # noqa: E731
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]  # every rank's, each turn (`any` would stop at the first live one)
            if all(c is not None for c in codes):
                break
            if not started() and any(codes):
                break  # a rank died in start-up: the others would wait for it until their timeout
            time.sleep(0.5)
        early = not started()
        errors, own = [], []
        for r, proc in enumerate(procs):
            killed = proc.poll() is None
            if killed:
                proc.kill()
            proc.wait()
            if proc.returncode:
                text = (Path(tmp) / f"err{r}").read_text(errors="replace")[-6000:]
                errors.append(f"rank {r} exited with {proc.returncode}:\n{text}")
                if not killed:
                    own.append(errors[-1])
        if errors and early:  # every rank that died by itself, with its last line (the cause is usually there)
            raise StartupError("; ".join(" ".join(dict.fromkeys([lines[0], lines[-1]])) for lines in
                                         ([x for x in e.splitlines() if x.strip()] for e in own or errors)))
        if errors:
            raise RuntimeError("\n".join(errors))
        return json.loads(out.read_text())


def rank_worker(spec_path: str, out: str, worker: Callable[[int, int, dict[str, Any]], Any]) -> int:
    """One rank of `run_shaped` (environment from it): join the gloo job, run `worker(rank, world, spec)`, rank 0
    writes its result as JSON to `out`; the exit code says whether it went well (the traceback on stderr)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        res = worker(rank, world, json.loads(Path(spec_path).read_text()))
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    except BaseException:  # noqa: BLE001 - reported to the parent through stderr and the exit code
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
