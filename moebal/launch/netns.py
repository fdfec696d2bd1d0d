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
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

__all__ = ["NamespacePair", "sweep_stale", "unavailable"]

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
