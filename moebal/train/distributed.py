"""What the trainer needs to know about the other ranks, and the hooks of distributed training.

`RunContext` answers the trainer's few distributed questions (which rows of the global batch are mine, the
mean of a number over ranks, the global gradient norm, am I the rank that writes files) for a single process
and for any data x expert-parallel layout, so the trainer never branches on `torch.distributed` itself.

`setup_parallel` joins the job and builds the model and its hooks: under expert parallelism the expert
balancer's hook (`moebal/balance/experts.py`: observe, plan, apply Pro-Prophet placement, with its loop
closed), else plain data parallelism (`DataParallelHook`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.config import Config, refuse_cpu_only
from moebal.distributed.autograd import sum_gradients
from moebal.distributed.expert_parallel import ExpertParallel, StatsReducer, is_expert_param
from moebal.distributed.groups import ParallelDims, env_world, pick_device
from moebal.errors import ConfigError
from moebal.routing import RoutingStats
from moebal.scheduler import CommScheduler
from moebal.sync import to_host
from moebal.train.checkpoint import Checkpointer
from moebal.train.hooks import Hook

if TYPE_CHECKING:
    from moebal.data import Batch
    from moebal.train.trainer import Trainer

__all__ = ["RunContext"]


class RunContext:
    """The trainer's view of the job: one process (the default) or `dims.world_size` ranks."""

    def __init__(self, dims: ParallelDims | None = None) -> None:
        self.dims = dims or ParallelDims(world_size=1, rank=0)
        self.comm: CommScheduler | None = None  # when set, the bookkeeping collectives go through it too

    def _all_reduce(self, t: torch.Tensor, group: Any, name: str, op: Any = None) -> torch.Tensor:
        if self.comm is not None:
            return self.comm.all_reduce(t, group, name=name, op=op)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
        return t

    @property
    def distributed(self) -> bool:
        return self.dims.world_size > 1

    @property
    def is_main(self) -> bool:
        """The rank that writes metrics, plans, the dashboard and the progress display."""
        return self.dims.rank == 0

    @property
    def data_ranks(self) -> int:
        """Ranks that split one global batch between them (every rank of a pipeline stage)."""
        return self.dims.size("dp_ep")

    def check_batch(self, batch_size: int, micro_batches: int = 1) -> None:
        """Every rank gets as many rows, which split into `micro_batches` equal ones (`train.grad_accum`)."""
        n = self.data_ranks * micro_batches
        if batch_size % n:
            split = (f"the {self.data_ranks} ranks that share a batch" if micro_batches == 1 else
                     f"{self.data_ranks} ranks x train.grad_accum={micro_batches} micro-batches")
            raise ConfigError(f"data.batch_size ({batch_size}) is not divisible by {split}: choose a batch size "
                              f"that is a multiple of {n}")

    def shard(self, batch: Batch) -> tuple[Batch, float]:
        """My rows of the global batch, and the factor that makes my mean-per-token loss a share of the global
        mean-per-token loss once gradients are averaged over ranks (1.0 when every rank has as many tokens)."""
        if not self.distributed:
            return batch, 1.0
        n = self.data_ranks
        mine = batch.part(self.dims.index("dp_ep"), n)
        return mine, mine.n_tokens * n / max(batch.n_tokens, 1)

    def global_rows(self, local_RX: np.ndarray, batch_rows: int) -> np.ndarray:
        """[batch_rows, X]: every rank's per-row values of its shard (`shard`'s rows) in global row order. Exact:
        each entry is one rank's value plus zeros. Host data in, host data out: a CPU tensor, so gloo carries it
        (on CUDA an NCCL round trip would add an upload and a read-back)."""
        if not self.distributed:
            return local_RX
        n, i = self.data_ranks, self.dims.index("dp_ep")
        rows = batch_rows // n
        full = torch.zeros((batch_rows, local_RX.shape[1]), dtype=torch.float64)
        full[i * rows:(i + 1) * rows] = torch.from_numpy(np.asarray(local_RX, dtype=np.float64))
        self._all_reduce(full, self.dims.group("dp_ep"), "rows")
        return full.numpy()

    def mean(self, value: float) -> float:
        """Mean of a number over the ranks sharing a batch (a host value: a CPU tensor over gloo)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self._all_reduce(t, self.dims.group("dp_ep"), "mean")
        return float(t.item()) / self.data_ranks

    def means(self, values: list[torch.Tensor]) -> list[float]:
        """Means over the ranks sharing a batch of per-step device scalars (the loss, the auxiliary loss): one
        stacked float64 tensor on their device, one all-reduce (NCCL on CUDA), one host read, instead of a host
        read and a gloo all-reduce per value."""
        v = torch.stack([x.detach().reshape(()).double() for x in values])
        if self.distributed:
            self._all_reduce(v, self.dims.group("dp_ep"), "means")
            v = v / self.data_ranks
        return [float(x) for x in to_host(v, "step record")]

    def sum(self, values: list[float]) -> list[float]:
        """Sums of host numbers over the ranks sharing a batch (a CPU tensor over gloo)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self._all_reduce(t, self.dims.group("dp_ep"), "sum")
        return t.tolist()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: replicated gradients count once, expert shards are
        summed over the expert-parallel group (each rank holds different experts). Everything stays on the
        gradients' device (the expert all-reduce goes to NCCL on CUDA); no host read."""
        held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        if not self.distributed:
            return torch.nn.utils.clip_grad_norm_([p for p, _ in held], max_norm)
        device = held[0][1].device if held else self.dims.device
        dense = [g.float().square().sum() for p, g in held if not is_expert_param(p)]
        expert = [g.float().square().sum() for p, g in held if is_expert_param(p)]
        sq_dense = torch.stack(dense).sum() if dense else torch.zeros((), device=device)
        sq_expert = torch.stack(expert).sum() if expert else torch.zeros((), device=device)
        if self.dims.size("ep") > 1:
            self._all_reduce(sq_expert, self.dims.group("ep"), "gradient norm")
        total = (sq_dense + sq_expert).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for _, g in held:
                g.mul_(coef.to(g.dtype))
        return total

    # ---- checkpoints (moebal/train/checkpoint.py) ----
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON-like data), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.dims.world_size
        dist.all_gather_object(out, obj)
        return out

    def layout(self) -> dict[str, int]:
        """The parallel layout, as checkpoints record it (a resume under another one reshards)."""
        d = self.dims
        return {"world_size": d.world_size, "pp": d.pp, "dp": d.dp, "ep": d.ep}

    def checkpointer(self, run_dir: Path, keep: int, background: bool, reach: int = 0) -> Checkpointer:
        """This rank's checkpoint writer. Every logical tensor is written once: dense ones by the first rank
        of the stage's data x expert group, experts by the first rank of their data-parallel group.
        Collective (the ranks agree on a session name for their temporary directories)."""
        session = self.gather(f"{int(time.time())}-{os.getpid()}")[0]
        return Checkpointer(run_dir, rank=self.dims.rank, ranks=range(self.dims.world_size),
                            write_dense=self.dims.index("dp_ep") == 0, write_experts=self.dims.index("dp") == 0,
                            keep=keep, background=background, session=session, reach=reach)


def setup_parallel(cfg: Config, load_weights: bool = True, run_dir: Path | None = None,
                   resume: bool = False, dims: ParallelDims | None = None) -> tuple[RunContext, torch.nn.Module,
                                                                                   list[Hook]]:
    """Join the job described by the torchrun environment (or take the process groups `dims` of a job already
    joined: a rollback builds the trainer again) and build this rank's model and hooks.

    With `scheduler.expert_packing: lina` the expert-parallel size is chosen first (measured on the job, or
    read from `run_dir`'s packing.json when the run `resume`s; moebal/balance/packing.py).

    Under expert parallelism a rank materialises only its own experts' rows: from the run's seed on the meta
    device (moebal/models/local_init.py: bit-identical to those rows of the single-process model), or from
    `hf.init_from` (unless `load_weights` is false because a checkpoint will overwrite it), reading the shared
    weights and its own experts only. Without it every rank builds the whole model, as one process would. The planner's
    coefficients come from `planner.costs`, the communication scheduler's from the same source (measured on
    the job, or the hardware profile).
    """
    from moebal.models import build_model
    from moebal.train.memory import settle_shard

    cfg = settle_shard(cfg)  # parallel.shard auto: the memory plan's choice (the trainer settles it alike)
    from moebal.train.trainer import seed_everything

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = cfg.parallel.pp
    if pp != 1:
        raise ConfigError("parallel.pp > 1 runs the pipeline engine (moebal.pipeline); this entry point builds "
                          "data and expert parallelism only")
    ep = dims.ep if dims is not None else cfg.parallel.ep or world
    if dims is None and cfg.scheduler.expert_packing != "off" and world > 1 and cfg.moe.num_experts:
        from moebal.balance.packing import choose_expert_parallel

        rank, _, local = env_world()
        ep = choose_expert_parallel(cfg, world, rank, pick_device(local), min(ep, cfg.moe.num_experts), run_dir,
                                    resume)
    if cfg.moe.num_experts and cfg.moe.num_experts % ep:
        raise ConfigError(f"moe.num_experts ({cfg.moe.num_experts}) is not divisible by the expert-parallel size "
                          f"{ep}: set parallel.ep (--ep) to a divisor of it")
    if cfg.moe.num_experts == 0:
        ep = 1
    from moebal.balance.experts import refuse_idle_plan_ahead

    refuse_idle_plan_ahead(cfg, ep, world)
    if dims is None:
        dims = ParallelDims.from_env(ep=ep, pp=pp).init(timeout_s=60.0 * cfg.parallel.timeout_min)
    refuse_cpu_only(cfg, dims.device.type)
    ctx = RunContext(dims)
    seed_everything(cfg.train.seed)
    if dims.distributed and ep > 1 and cfg.moe.num_experts:
        # A rank never holds the whole model: only its own experts are read or initialised.
        from moebal.models.local_init import Holding, build_local
        from moebal.planner.plan import default_owners

        owners, r = default_owners(cfg.moe.num_experts, ep), dims.index("ep")
        owned = [e for e, o in enumerate(owners) if o == r]
        if cfg.hf.init_from and load_weights:
            from moebal.interop.hf import from_hf

            model = from_hf(cfg.hf.init_from, cfg=cfg, device=dims.device, experts=owned)
        else:
            model = build_local(cfg, Holding(experts=tuple(owned))).to(dims.device)
    else:
        model = build_model(cfg, load_weights=load_weights).to(dims.device)
    hooks: list[Hook] = []
    if dims.distributed and ep > 1 and cfg.moe.num_experts:
        sc = cfg.scheduler
        # the device chooses the completion (a stream wait on CUDA); channels and groups exist and are warm
        # (ParallelDims.init) before the scheduler's thread can issue on them
        sched = CommScheduler(sc.mode, rank=dims.rank, device=dims.device, inflight=sc.inflight,
                              lookahead=sc.lookahead, predict=sc.predict, timeout_s=sc.timeout_s, dilate=sc.dilate)
        from moebal.train.precision import autocast_dtype

        # sharded state: the optimizer reduce-scatters gradients itself (moebal/distributed/sharded.py)
        expert_parallel = ExpertParallel(model, dims, sched, overlap=sc.block_overlap,
                                         compute_dtype=autocast_dtype(cfg, dims.device),
                                         sync_gradients=cfg.parallel.shard == "none")
        ctx.comm = sched
        from moebal.balance.experts import expert_parallel_hook

        hooks.append(expert_parallel_hook(cfg, expert_parallel, dims, ctx))
    elif dims.distributed:
        hooks.append(DataParallelHook(dims, sync_gradients=cfg.parallel.shard == "none"))
        # experts replicated on every rank: the balancing and z losses still come from the statistics of the
        # global batch, as under expert parallelism and in a pipeline's stages, not a mean of each rank's
        reducer = StatsReducer(dims.group("dp_ep"))
        for moe in model.moe_layers():
            moe.set_stats_reducer(reducer)
    return ctx, model, hooks


class DataParallelHook(Hook):
    """Plain data parallelism (a dense model, or experts replicated): average every gradient over the ranks
    (unless `sync_gradients` is false: a sharded optimizer reduce-scatters them itself)."""

    def __init__(self, dims: ParallelDims, sync_gradients: bool = True) -> None:
        self.dims, self.sync = dims, sync_gradients

    def after_backward(self, trainer: Trainer, step: int) -> None:
        if not self.sync:
            return
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        sum_gradients(params, self.dims.group("dp_ep"), self.dims.size("dp_ep"))

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        return sum_stats(stats, self.dims.group("dp_ep"))


def sum_stats(stats: list[RoutingStats], group: Any) -> list[RoutingStats]:
    """Routing statistics summed over the ranks of `group` with one all-reduce of every layer's packed
    statistics (copies; the inputs stay local)."""
    if not stats:
        return []
    packed_LX = torch.stack([s.packed() for s in stats])
    dist.all_reduce(packed_LX, group=group)
    E = stats[0].counts_E.numel()
    return [RoutingStats.unpack(packed_LX[i], E) for i in range(len(stats))]
