"""Point-to-point communication along one pipeline: the ordered chain of ranks that run its stages.

Everything along the pipeline axis goes through point-to-point messages between chain members, never
through a collective over a process group: activations and gradients, the per-layer statistics every
stage needs to plan (`allreduce_sum`), migrated layers. That is what lets re-packing shrink the chain
without building a new group: released ranks simply stop, and no collective can wait for them (DynMo's
release by communicator splitting needs every rank, including the leaving ones, to join the split).

Rules that keep the pipeline deadlock-free: sends are non-blocking (`isend`, handles kept until `flush`);
receives block. Messages between one pair of ranks in one direction arrive in the order they were sent.
On NCCL a send is non-blocking for the host but not for the device: it occupies its communicator's stream
until the peer posts the matching receive (for messages beyond NCCL's buffers), and a rank's messages on one
communicator run in issue order. In 1F1B, stage p sends activation a forward and then receives gradient b,
while stage p + 1 sends gradient b back and then receives activation a: on one stream per rank each send
waits behind nothing but blocks the receive its peer needs, a deadlock. So a chain built with the
pipeline's two groups (`ParallelDims.pipe_groups`) sends every message toward later stages on the first and
every message toward earlier stages on the second: on each group a pair of ranks exchanges messages in one
direction only, in FIFO order, and along the chain the "later" relation has no cycle, so every send's
receive is eventually posted (the messages keep gloo's semantics; on gloo the split changes nothing).

Waiting. A blocked gloo receive sleeps, so on a machine with fewer cores than ranks an idle stage hands its
core to the busy ones, which a GPU cannot do. `wait="spin"` emulates dedicated devices on one host: the
receiver spins on a shared-memory counter that the sender bumps after posting its send, so every rank
keeps its share of the CPU while it waits. It is a benchmark device, valid for ranks of one host only (and
refused on CUDA: `moebal.config.refuse_cpu_only`).

Devices. Messages go over the default group, device-aware on CUDA (`cpu:gloo,cuda:nccl`): a CUDA tensor
travels over NCCL, a CPU tensor over gloo, so both ends of a message must use the same device type. The
convention: activations, gradients and migrated layers on the compute device; the small agreements
(`allreduce_sum` of per-layer statistics and times, `allgather_1d`'s lengths) on the CPU, since they are host
values read on the host at once. On NCCL a receive returns once it is ordered before the compute stream's
next kernel (the data are not yet on the host), which is all a tensor consumed by GPU code needs.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.errors import ConfigError

__all__ = ["PipeChain"]


class _SpinBoard:
    """world x world message counters in shared memory: [src, dst] counts messages src has posted to dst."""

    def __init__(self, world: int) -> None:
        """Collective over the default group: rank 0 creates a fresh segment and tells the others its name."""
        from multiprocessing import shared_memory

        name = [f"moebal_pp_{os.getpid()}_{uuid.uuid4().hex[:12]}"]
        if dist.get_rank() == 0:
            self.shm = shared_memory.SharedMemory(name=name[0], create=True, size=world * world * 8)
            np.ndarray((world, world), dtype=np.int64, buffer=self.shm.buf)[:] = 0
        dist.broadcast_object_list(name, src=0)
        self.owner = dist.get_rank() == 0
        if not self.owner:
            # Python < 3.13 registers an attached segment with the resource tracker too, which unlinks it when
            # the process exits: harmless (unlinking only removes the name once everyone is attached)
            self.shm = shared_memory.SharedMemory(name=name[0], create=False)
        dist.barrier()
        self.counts = np.ndarray((world, world), dtype=np.int64, buffer=self.shm.buf)
        self.seen = np.zeros(world, dtype=np.int64)
        self.posted = np.zeros(world, dtype=np.int64)

    def posted_to(self, me: int, dst: int) -> None:
        self.posted[dst] += 1
        self.counts[me, dst] = self.posted[dst]  # one writer per slot: a plain store is enough

    def wait_from(self, src: int, me: int) -> None:
        self.seen[src] += 1
        self.wait_count(src, me, int(self.seen[src]))

    def wait_count(self, src: int, me: int, target: int) -> None:
        """Until src has posted its target-th message to me."""
        while self.counts[src, me] < target:  # busy wait: holds this rank's CPU share like a device would
            pass

    def close(self) -> None:
        del self.counts
        self.shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):  # an attached process's resource tracker was first
                self.shm.unlink()


class PipeChain:
    """The ordered global ranks of one pipeline and this rank's place in it."""

    def __init__(self, ranks: Sequence[int], rank: int, wait: str = "block",
                 groups: tuple[Any, Any] | None = None) -> None:
        """`groups`: (toward later members, toward earlier members) over the chain's ranks, or None for the
        default group (a single process, tests)."""
        if rank not in ranks:
            raise ConfigError(f"rank {rank} is not in the pipeline {list(ranks)}")
        if wait not in ("block", "spin"):
            raise ConfigError(f"pipeline wait mode must be 'block' or 'spin'; got {wait!r}")
        self.ranks, self.rank, self.wait = list(ranks), rank, wait
        self._groups = groups
        self._pos = {r: i for i, r in enumerate(self.ranks)}  # chain order, kept when the chain shrinks
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._board: _SpinBoard | None = None
        self.bytes_sent = 0
        if wait == "spin" and dist.is_initialized():
            self._board = _SpinBoard(dist.get_world_size())

    # ---- places ----
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def prev(self) -> int:
        return self.ranks[self.index - 1]

    @property
    def next(self) -> int:
        return self.ranks[self.index + 1]

    def shrink(self, keep: Sequence[int]) -> None:
        """Continue on the chain members `keep` (in chain order); the others have been released."""
        self.flush()
        self.ranks = [r for r in self.ranks if r in set(keep)]

    # ---- messages ----
    def _group(self, src: int, dst: int) -> Any:
        """The group of a message from src to dst (see the module docstring); None: the default group."""
        if self._groups is None:
            return None
        return self._groups[0] if self._pos[dst] > self._pos[src] else self._groups[1]

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Post a send of t; t stays referenced until the send completes (memory: the sends still in flight,
        never the whole iteration's: completed ones are dropped at each send)."""
        t = t.detach().contiguous()
        self._reap()
        work = dist.isend(t, dst, group=self._group(self.rank, dst))
        self._pending.append((work, t))
        self.bytes_sent += t.numel() * t.element_size()
        if self._board is not None:
            self._board.posted_to(self.rank, dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self._board is not None:
            self._board.wait_from(src, self.rank)
        dist.recv(t, src, group=self._group(src, self.rank))  # blocking (on NCCL: ordered on the stream)
        return t

    # ---- posted transfers (planned communication: Start now, Wait later) ----
    def post_send(self, t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
        """Start a send; the handle keeps the tensor alive until `wait_send`."""
        t = t.detach().contiguous()
        work = dist.isend(t, dst, group=self._group(self.rank, dst))
        self.bytes_sent += t.numel() * t.element_size()
        if self._board is not None:
            self._board.posted_to(self.rank, dst)
        return work, t

    def wait_send(self, handle: tuple[Any, torch.Tensor]) -> None:
        handle[0].wait()

    def post_recv(self, t: torch.Tensor, src: int) -> tuple[Any, int, int]:
        """Start a receive into t. Messages between two ranks match in posting order on both sides (gloo and
        NCCL), so the k-th receive from src gets src's k-th send to this rank."""
        group = self._group(src, self.rank)
        if self._board is not None:
            self._board.seen[src] += 1
            return dist.irecv(t, src, group=group), src, int(self._board.seen[src])
        return dist.irecv(t, src, group=group), src, 0

    def wait_recv(self, handle: tuple[Any, int, int]) -> None:
        work, src, seq = handle
        if self._board is not None:
            self._board.wait_count(src, self.rank, seq)
        work.wait()

    def _reap(self) -> None:
        """Drop the sends that have completed, so their buffers free (a query, no wait: on NCCL an event query of
        the communication stream, no host sync); `wait` on each first returns at once and raises a failed send's
        error."""
        if not self._pending:
            return
        held = []
        for work, t in self._pending:
            if work.is_completed():
                work.wait()
            else:
                held.append((work, t))
        self._pending = held

    def flush(self) -> None:
        """Wait for every send posted so far (their buffers may then be reused or freed)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- small agreements along the chain ----
    def allreduce_sum(self, vec: torch.Tensor) -> torch.Tensor:
        """Sum of every member's `vec`, added in chain order on every member: all members get the same bits.

        P x (P - 1) messages of len(vec) numbers; meant for per-layer statistics and scalars, not gradients, and
        for CPU tensors (gloo): every member sends before it receives, which NCCL, whose sends may wait for the
        matching receive, does not promise to complete.
        """
        assert vec.device.type == "cpu", "allreduce_sum sends before it receives: CPU tensors (gloo) only"
        vec = vec.detach().contiguous()
        if self.size == 1:
            return vec.clone()
        for r in self.ranks:
            if r != self.rank:
                self.send(vec, r)
        parts = []
        for r in self.ranks:
            parts.append(vec if r == self.rank else self.recv(torch.empty_like(vec), r))
        self.flush()
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def allgather_1d(self, vec: torch.Tensor) -> list[torch.Tensor]:
        """Every member's 1-D tensor (lengths may differ), in chain order. CPU tensors only, like
        `allreduce_sum` (every member sends before it receives)."""
        assert vec.device.type == "cpu", "allgather_1d sends before it receives: CPU tensors (gloo) only"
        n = self.allreduce_sum(self._one_hot(vec.numel())).long().tolist()
        vec = vec.detach().contiguous()
        for r in self.ranks:
            if r != self.rank and vec.numel():
                self.send(vec, r)
        out = []
        for i, r in enumerate(self.ranks):
            if r == self.rank:
                out.append(vec)
            else:
                buf = torch.empty(int(n[i]), dtype=vec.dtype, device=vec.device)
                out.append(self.recv(buf, r) if n[i] else buf)
        self.flush()
        return out

    def gather_1d(self, vec: torch.Tensor) -> list[torch.Tensor] | None:
        """Every member's 1-D tensor (lengths may differ), in chain order, on the first member; None on the
        others. P - 1 length messages and P - 1 data messages (`allgather_1d` sends P x (P - 1)): for larger
        host payloads only one member needs, such as a routing sample. CPU tensors only, like `allreduce_sum`."""
        assert vec.device.type == "cpu", "gather_1d sends before it receives: CPU tensors (gloo) only"
        vec = vec.detach().contiguous()
        first = self.ranks[0]
        if self.rank != first:
            self.send(torch.tensor([vec.numel()], dtype=torch.int64), first)
            if vec.numel():
                self.send(vec, first)
            self.flush()
            return None
        out = []
        for r in self.ranks:
            if r == self.rank:
                out.append(vec)
                continue
            n = int(self.recv(torch.zeros(1, dtype=torch.int64), r)[0])
            buf = torch.empty(n, dtype=vec.dtype)
            out.append(self.recv(buf, r) if n else buf)
        return out

    def _one_hot(self, value: float) -> torch.Tensor:
        v = torch.zeros(self.size, dtype=torch.float64)  # a host value: gloo
        v[self.index] = value
        return v

    def close(self) -> None:
        self.flush()
        if self._board is not None:
            self._board.close()
            self._board = None
