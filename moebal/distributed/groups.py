"""The one place that builds process groups. Everyone else asks `dims.group("ep")` by axis name.

Rank layout (row-major, expert-parallel innermost so an EP group sits on consecutive ranks, i.e. inside a
node when ranks are placed node by node):

    rank = ((pp_index * dp) + dp_index) * ep + ep_index

Axes:
    "ep"     ranks that split one stage's experts between them (tokens travel by all-to-all);
    "dp"     ranks holding the same expert shard (expert gradients are averaged here);
    "dp_ep"  every rank of one pipeline stage (non-expert gradients are averaged here);
    "pp"     the pipeline stages of one (dp, ep) coordinate (activations travel by send/recv);
    "world"  everyone.

The device and backend are chosen at run time (`backend_for`): on CUDA every group is device-aware,
`cpu:gloo,cuda:nccl`, so one group object carries CUDA tensors over NCCL and CPU tensors (rare bookkeeping:
an agreed chunk size, object gathers) over gloo; on CPU it is gloo alone. On CUDA the default group is bound to
the rank's GPU (`device_id`), so NCCL communicators are created eagerly, every subgroup is split from the
default one, and `warm_up` runs one tiny collective on every group and channel from the main thread before any
helper thread (the communication scheduler's) issues on them. The process-group timeout (NCCL's watchdog) is
`parallel.timeout_min`, separate from the scheduler's own `scheduler.timeout_s`.

Ring order of all-reduce channels (`new_channel(..., ring_by_node=True)`): gloo's ring all-reduce passes data
from group rank i to i + 1, so its bytes on the network depend on how the ranks sit on nodes. With ranks
placed node by node (torchrun's layout) the ring crosses between nodes once per node pair; with nodes
interleaved (rank r on node r % 2, which puts every expert-parallel pair across the network) every hop crosses
and a 4-rank all-reduce puts twice the bytes on each link (measured: a 1 MB all-reduce over a 300 Mbit/s link
took 155 ms against 41 ms in node order). Channels that carry all-reduces are therefore built in node order:
the group's ranks sorted by node (nodes in order of their lowest rank), as NCCL orders its rings by topology
itself (so on CUDA nothing changes). A node is a (hostname, network namespace) pair, or `ParallelDims.node`.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moebal.errors import ConfigError

__all__ = ["ParallelDims", "backend_for", "check_env_world", "check_ranks_fit", "env_world", "pick_device"]

AXES = ("pp", "dp", "ep", "dp_ep", "world")


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun environment; (0, 1, 0) when absent (`check_env_world`)."""
    check_env_world()
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def check_env_world() -> None:
    """The torchrun environment of a rank started by hand is consistent (ConfigError naming the variable
    otherwise): RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE integers where set, 0 <= RANK < WORLD_SIZE,
    0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, and for more than one rank the rendezvous address (MASTER_ADDR, and
    MASTER_PORT a port number). torchrun and `moebal train --nproc` set all of them."""
    env = os.environ
    fix = "launch with torchrun (or moebal launch) or moebal train --nproc N"
    got: dict[str, int] = {}
    for key, default, low in (("WORLD_SIZE", 1, 1), ("RANK", 0, 0), ("LOCAL_RANK", 0, 0), ("LOCAL_WORLD_SIZE", 1, 1)):
        raw = env.get(key)
        try:
            got[key] = default if raw is None else int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {key}={raw!r} must be an integer: {fix}") from None
        if got[key] < low:
            raise ConfigError(f"environment variable {key}={raw} must be at least {low}: {fix}")
    for key, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if key in env and size in env and got[key] >= got[size]:
            raise ConfigError(f"environment variable {key}={got[key]} is not below {size}={got[size]}: {fix}")
    if got["WORLD_SIZE"] > 1:
        if not env.get("MASTER_ADDR"):
            raise ConfigError(f"WORLD_SIZE={got['WORLD_SIZE']} but MASTER_ADDR is not set (the rendezvous host): "
                              f"{fix}")
        port = env.get("MASTER_PORT", "")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"environment variable MASTER_PORT={port!r} must be a port number (1-65535): {fix}")


def backend_for(device: torch.device) -> str:
    """The process-group backend for a job whose compute device is `device`: on CUDA gloo for CPU tensors and
    NCCL for CUDA tensors in one group (NCCL rejects CPU tensors, and bookkeeping values often live on the
    host), on CPU gloo."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_ranks_fit(local_ranks: int, gpus: int) -> None:
    """On CUDA every rank of a machine needs a GPU of its own: NCCL refuses two ranks on one device."""
    if local_ranks > gpus:
        raise ConfigError(f"{local_ranks} ranks on this machine but {gpus} visible GPU(s): NCCL needs one GPU per "
                          f"rank; set parallel.nproc (--nproc, torchrun --nproc-per-node) to at most {gpus}, or make "
                          f"more GPUs visible (CUDA_VISIBLE_DEVICES)")


def pick_device(local_rank: int = 0, local_ranks: int | None = None) -> torch.device:
    """CUDA device `local_rank` when CUDA is present (a ConfigError when the machine's `local_ranks` ranks
    outnumber its GPUs), else the CPU."""
    if torch.cuda.is_available():
        check_ranks_fit(max(local_rank + 1, local_ranks or 0), torch.cuda.device_count())
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class ParallelDims:
    """Sizes of the parallel axes and, once `init()` ran, their process groups."""

    world_size: int
    rank: int
    ep: int = 1
    pp: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    node: str | None = None
    """This process's node (ranks on one node share it); None: its hostname and network namespace."""
    _groups: dict[str, Any] = field(default_factory=dict, repr=False)
    _nodes: list[str] | None = field(default=None, repr=False)
    _channels: list[Any] = field(default_factory=list, repr=False)
    _pipe: tuple[Any, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.ep < 1 or self.pp < 1 or self.world_size % (self.ep * self.pp):
            raise ConfigError(f"world size {self.world_size} is not divisible by ep ({self.ep}) x pp ({self.pp}): "
                              f"choose parallel.ep and parallel.pp whose product divides the number of processes")

    @property
    def dp(self) -> int:
        return self.world_size // (self.ep * self.pp)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's index along pp, dp and ep."""
        ep_i = self.rank % self.ep
        dp_i = (self.rank // self.ep) % self.dp
        pp_i = self.rank // (self.ep * self.dp)
        return {"pp": pp_i, "dp": dp_i, "ep": ep_i}

    def ranks_of(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks in `rank`'s group along `axis` (ascending)."""
        r = self.rank if rank is None else rank
        ep_i, dp_i, pp_i = r % self.ep, (r // self.ep) % self.dp, r // (self.ep * self.dp)

        def at(p: int, d: int, e: int) -> int:
            return (p * self.dp + d) * self.ep + e

        if axis == "ep":
            return [at(pp_i, dp_i, e) for e in range(self.ep)]
        if axis == "dp":
            return [at(pp_i, d, ep_i) for d in range(self.dp)]
        if axis == "dp_ep":
            return [at(pp_i, d, e) for d in range(self.dp) for e in range(self.ep)]
        if axis == "pp":
            return [at(p, dp_i, ep_i) for p in range(self.pp)]
        if axis == "world":
            return list(range(self.world_size))
        raise KeyError(f"unknown parallel axis {axis!r}; axes: {', '.join(AXES)}")

    def size(self, axis: str) -> int:
        return len(self.ranks_of(axis))

    def index(self, axis: str) -> int:
        """This rank's position inside its group along `axis`."""
        return self.ranks_of(axis).index(self.rank)

    # ---- process groups ----
    @classmethod
    def from_env(cls, ep: int = 1, pp: int = 1) -> ParallelDims:
        rank, world, local = env_world()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
        return cls(world_size=world, rank=rank, ep=ep, pp=pp, local_rank=local,
                   device=pick_device(local, local_ranks))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def init(self, timeout_s: float = 1800.0) -> ParallelDims:
        """Join the default group (torchrun env), build every axis group and warm them up. Collective on all
        ranks. `timeout_s`: the process groups' timeout (NCCL's watchdog; `parallel.timeout_min`), long enough
        for one rank's checkpoint or weight load while the others already wait in a collective."""
        if not self.distributed:
            return self
        backend = backend_for(self.device)
        timeout = datetime.timedelta(seconds=timeout_s)
        bind: dict[str, Any] = {}
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            # bound to its GPU, the group creates NCCL communicators now (not at the first collective, maybe
            # from a helper thread) and subgroups split from it (ncclCommSplit) instead of a fresh rendezvous
            bind["device_id"] = self.device
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timeout, rank=self.rank, world_size=self.world_size,
                                    **bind)
        # new_group is collective over the whole world and must be called in the same order everywhere,
        # so every rank creates every group of every axis and keeps the ones it belongs to.
        for axis in ("ep", "dp", "dp_ep", "pp"):
            for ranks in self._axis_groups(axis):
                g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
                if self.rank in ranks:
                    self._groups[axis] = g
        self._groups["world"] = dist.group.WORLD
        if self.pp > 1:
            for ranks in self._axis_groups("pp"):
                pair = tuple(dist.new_group(list(ranks), timeout=timeout, backend=backend) for _ in range(2))
                if self.rank in ranks:
                    self._pipe = (pair[0], pair[1])
        self.warm_up()
        return self

    def pipe_groups(self) -> tuple[Any, Any] | None:
        """Two groups over this rank's pipeline ("pp") for its point-to-point messages: those toward later
        stages (activations) and those toward earlier ones (gradients); None in a single process or without
        pipeline stages. On NCCL each group has its own stream, on which a large send waits for its receive:
        with one stream for both directions, a stage sending forward and its neighbour sending backward would
        each wait behind their own send (`moebal.pipeline.p2p`)."""
        return self._pipe if self.distributed else None

    def _axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis`, each once, in the order every rank creates them."""
        out: list[tuple[int, ...]] = []
        for r in range(self.world_size):
            ranks = tuple(self.ranks_of(axis, r))
            if ranks not in out:
                out.append(ranks)
        return out

    def warm_up(self) -> None:
        """One tiny all-reduce on every axis group from the calling thread (collective on all ranks, in axis
        order: each axis's groups partition the world, so no rank waits on a group another has not reached).
        NCCL communicators must exist before the communication scheduler's thread issues on them, and a broken
        interface shows here, at start-up, not at the first step. On CUDA both backends are exercised."""
        if not self.distributed:
            return
        for axis in ("ep", "dp", "dp_ep", "pp", "world"):
            self._warm(self._groups[axis])
        for g in self._pipe or ():
            self._warm(g)

    def _warm(self, group: Any, devices: tuple[torch.device, ...] | None = None) -> None:
        for device in devices or _devices(self.device):
            t = torch.ones(1, device=device)
            dist.all_reduce(t, group=group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the NCCL all-reduce has finished, not only been enqueued

    def nodes(self) -> list[str]:
        """The node of every rank (collective on all ranks the first time, cached)."""
        if self._nodes is None:
            mine = self.node
            if mine is None:
                try:
                    netns = str(os.stat("/proc/self/ns/net").st_ino)
                except OSError:
                    netns = ""
                mine = f"{socket.gethostname()}/{netns}"
            if not self.distributed:
                self._nodes = [mine]
            else:
                out: list[Any] = [None] * self.world_size
                dist.all_gather_object(out, mine)
                self._nodes = [str(x) for x in out]
        return self._nodes

    def ring_order(self, axis: str, rank: int | None = None) -> list[int]:
        """`rank`'s group along `axis` in node order (see the module docstring). Collective the first time."""
        nodes = self.nodes()
        first: dict[str, int] = {}
        for r, n in enumerate(nodes):
            first.setdefault(n, r)
        return sorted(self.ranks_of(axis, rank), key=lambda r: (first[nodes[r]], r))

    def needs_node_ring(self, axis: str) -> bool:
        """Whether an all-reduce channel along `axis` is built in another order than ascending ranks (gloo with
        interleaved nodes, in any of the axis's groups). Collective the first time."""
        if not self.distributed or self.device.type == "cuda":
            return False
        return any(self.ring_order(axis, r) != self.ranks_of(axis, r) for r in range(self.world_size))

    def new_channel(self, axis: str, *, high_priority: bool = False, timeout_s: float | None = None,
                    ring_by_node: bool = False) -> Any:
        """A second communicator over the same ranks as `axis` (None in a single process). Collective on all
        ranks, in the same order everywhere.

        The communication scheduler owns its channels: nothing else issues on them, so the order of its
        collectives on a channel is its own fixed order on every rank, whatever other threads do on the axis's
        main group. `high_priority` asks NCCL for a high-priority stream (no effect on gloo). `ring_by_node`:
        a channel for all-reduces only (`dist.all_reduce(t, group=channel)`), its ring in node order when that
        differs from ascending ranks (then a gloo backend over the default store with group ranks in that
        order, not a full process group: no rank translation, so no point-to-point or gather on it)."""
        if axis not in AXES or axis == "world":
            raise KeyError(f"unknown parallel axis {axis!r} for a channel; axes: {', '.join(AXES[:-1])}")
        if not self.distributed:
            return None
        if ring_by_node and self.needs_node_ring(axis):
            return self._node_ring_channel(axis, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 1800.0)
        backend = backend_for(self.device)
        mine = None
        for ranks in self._axis_groups(axis):
            g = dist.new_group(list(ranks), timeout=timeout, backend=backend,
                               pg_options=self._nccl_options(high_priority, timeout))
            if self.rank in ranks:
                mine = g
        self._warm(mine)
        return mine

    def _nccl_options(self, high_priority: bool, timeout: datetime.timedelta) -> Any:
        """NCCL options of one new group (None: the defaults). A fresh object per group: torch records the
        group's name, ranks and split source in it, and the group keeps it. With the device-aware backend the
        options reach the NCCL part only (torch's gloo branch ignores `pg_options`), so CPU tensors on a
        high-priority channel still work."""
        if not (high_priority and self.device.type == "cuda"):
            return None
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        opts._timeout = timeout  # what new_group sets anyway; equal, so torch does not warn about an override
        return opts

    def _node_ring_channel(self, axis: str, timeout_s: float | None) -> Any:
        from torch.distributed.distributed_c10d import _get_default_store

        number = len(self._channels)
        self._channels.append(None)
        order = self.ring_order(axis)
        timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 1800.0)
        store = dist.PrefixStore(f"moebal-ring/{number}/{'-'.join(map(str, order))}/", _get_default_store())
        ch = dist.ProcessGroupGloo(store, order.index(self.rank), len(order), timeout)
        self._channels[-1] = ch
        self._warm(ch, (torch.device("cpu"),))
        return ch

    def group(self, axis: str) -> Any:
        """The process group along `axis` (None when running as a single process)."""
        if axis not in AXES:
            raise KeyError(f"unknown parallel axis {axis!r}; axes: {', '.join(AXES)}")
        return self._groups.get(axis) if self.distributed else None

    def release(self) -> None:
        """Destroy the axis groups `init` built, keeping the default group (which the job's other `ParallelDims`
        share): for a layout that was measured and dropped (`scheduler.expert_packing`), whose NCCL
        communicators would otherwise hold their buffers for the whole run. Every rank calls it at the same
        point, after the groups' last collective has finished; each rank shuts its own groups down in axis order,
        as `init` built them (NCCL's abort was collective in some versions, so no rank may be left waiting)."""
        if not self.distributed:
            return
        own = [self._groups[axis] for axis in ("ep", "dp", "dp_ep", "pp") if axis in self._groups]
        for g in [*own, *(self._pipe or ())]:
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)
        self._groups.clear()
        self._pipe = None

    def close(self) -> None:
        self._channels.clear()
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _devices(device: torch.device) -> tuple[torch.device, ...]:
    """The devices whose backends a group of a job on `device` carries (see `backend_for`)."""
    return (torch.device("cpu"), device) if device.type == "cuda" else (device,)
