"""What the trainer needs to know about the other ranks, and the expert-parallel balancing hook.

`RunContext` answers the trainer's few distributed questions (which rows of the global batch are mine, the
mean of a number over ranks, the global gradient norm, am I the rank that writes files) for a single process
and for any data x expert-parallel layout, so the trainer never branches on `torch.distributed` itself.

`ExpertParallelHook` is the per-step observe -> plan -> apply loop of Pro-Prophet on a real job:
  after the step     observe: all-gather every MoE layer's per-expert counts into R x E matrices
                     plan: one `ExpertPlanner` per layer forecasts step j+1 from step j (optionally EMA'd),
                     and the communication plan: token chunks per layer for step j+1 (moebal.planner.comm_plan)
  before the step    apply: adopt the placements and run Trans (owners send replica parameters)
  after backward     Agg (replica gradients back to their owners), then gradient sync
Every rank runs the same planners on the same all-gathered counts and the same measured coefficients, so
they agree on the plan without a broadcast. The coefficients are measured once per run and travel in the
checkpoints: a resumed run plans from the same figures, hence the same placements, as the uninterrupted one
(a re-measurement would differ and change replicas, so the summation order, so the last bits of the loss).
Every collective goes through the rank's `CommScheduler`, whose event log becomes comm/rank<r>.jsonl, a
Chrome trace of one step (comm_trace.json) and the step's exposed communication time in metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.config import Config, refuse_cpu_only
from moebal.distributed.autograd import sum_gradients
from moebal.distributed.expert_parallel import ExpertParallel, is_expert_param
from moebal.distributed.groups import ParallelDims, env_world, pick_device
from moebal.errors import ConfigError
from moebal.planner.comm_plan import CommCosts, a2a_chunks
from moebal.planner.perf import placement_loads
from moebal.planner.placement import ExpertPlanner, placement_metrics
from moebal.planner.plan import ExpertPlacement
from moebal.routing import RoutingStats
from moebal.scheduler import CommScheduler, step_record, write_chrome_trace
from moebal.sync import to_host
from moebal.train.checkpoint import Checkpointer
from moebal.train.hooks import Hook
from moebal.train.metrics import MetricsLog

if TYPE_CHECKING:
    from moebal.data import Batch
    from moebal.train.trainer import Trainer

__all__ = ["ExpertParallelHook", "RunContext"]


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

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.data_ranks:
            raise ConfigError(f"data.batch_size ({batch_size}) is not divisible by the {self.data_ranks} ranks that "
                              f"share a batch: choose a batch size that is a multiple of {self.data_ranks}")

    def shard(self, batch: Batch) -> tuple[Batch, float]:
        """My rows of the global batch, and the factor that makes my mean-per-token loss a share of the global
        mean-per-token loss once gradients are averaged over ranks (1.0 when every rank has as many tokens)."""
        if not self.distributed:
            return batch, 1.0
        from moebal.data import Batch

        n, i = self.data_ranks, self.dims.index("dp_ep")
        rows = batch.ids_BT.shape[0] // n
        ids, labels = batch.ids_BT[i * rows:(i + 1) * rows], batch.labels_BT[i * rows:(i + 1) * rows]
        mine = int((labels != -100).sum())
        scale = mine * n / max(batch.n_tokens, 1)
        return Batch(ids, labels, mine), scale

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
        params = [p for p in model.parameters() if p.grad is not None]
        if not self.distributed:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        device = params[0].grad.device if params else self.dims.device
        dense = [p.grad.float().square().sum() for p in params if not is_expert_param(p)]
        expert = [p.grad.float().square().sum() for p in params if is_expert_param(p)]
        sq_dense = torch.stack(dense).sum() if dense else torch.zeros((), device=device)
        sq_expert = torch.stack(expert).sum() if expert else torch.zeros((), device=device)
        if self.dims.size("ep") > 1:
            self._all_reduce(sq_expert, self.dims.group("ep"), "gradient norm")
        total = (sq_dense + sq_expert).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
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

    def checkpointer(self, run_dir: Path, keep: int, background: bool) -> Checkpointer:
        """This rank's checkpoint writer. Every logical tensor is written once: dense ones by the first rank
        of the stage's data x expert group, experts by the first rank of their data-parallel group.
        Collective (the ranks agree on a session name for their temporary directories)."""
        session = self.gather(f"{int(time.time())}-{os.getpid()}")[0]
        return Checkpointer(run_dir, rank=self.dims.rank, ranks=range(self.dims.world_size),
                            write_dense=self.dims.index("dp_ep") == 0, write_experts=self.dims.index("dp") == 0,
                            keep=keep, background=background, session=session)


class ExpertParallelHook(Hook):
    """Pro-Prophet's observe -> plan -> apply loop on a live expert-parallel job (see the module docstring)."""

    def __init__(self, ep: ExpertParallel, cfg: Config, costs: Any, ctx: RunContext,
                 measure: Callable[[], Any] | None = None, comm_costs: CommCosts | None = None,
                 measure_comm: Callable[[Any], CommCosts] | None = None) -> None:
        """`costs`: the planner's coefficients (from a hardware profile), or None with `measure`, which measures
        them on the job at the start of training unless a checkpoint brought the figures of the run's first
        measurement (live figures vary run to run, and placements follow them). `comm_costs` / `measure_comm`
        (given the layer costs): the same for the communication plan (gradient chunk size, token chunks)."""
        self.ep, self.ctx, self.costs, self._measure = ep, ctx, costs, measure
        self.comm_costs, self._measure_comm = comm_costs, measure_comm
        self.sched, self.sc = ep.sched, cfg.scheduler
        p = cfg.planner
        E, R = cfg.moe.num_experts, ep.dims.size("ep")
        overlap = p.overlap or cfg.scheduler.block_overlap  # hidden Trans/Agg are costed as such (eq. 8)
        self.planners = [ExpertPlanner(E, R, p.policy, costs, every=p.every, ema=p.ema, hysteresis=p.hysteresis,
                                       **({"overlap": True} if overlap and p.policy == "prophet" else {}))
                         for _ in ep.layers]
        self.placements: list[ExpertPlacement] = [pl.current for pl in self.planners]
        tokens = cfg.data.batch_size * cfg.data.seq_len // ep.dims.size("dp_ep") * cfg.moe.top_k
        self._uniform = np.full((R, E), tokens / E)
        self.token_bytes = cfg.model.dim * 4  # rows travel in the residual stream's dtype (fp32)
        self.chunks: list[int] | None = None  # token chunks per layer for the next step (None: not planned yet)
        self._log = None
        self._events = None
        self._t_opt = 0.0

    def _set_costs(self, costs: Any) -> None:
        self.costs = costs
        for pl in self.planners:
            pl.cost = costs

    @property
    def name(self) -> str:
        return "expert_parallel"

    def _chunks_for(self, counts_RE: np.ndarray, placement: ExpertPlacement) -> int:
        """Token chunks of one layer's exchanges (fixed by scheduler.a2a_chunks, else the cost model's best)."""
        if self.sc.a2a_chunks is not None:
            return self.sc.a2a_chunks
        if self.comm_costs is None:
            return 1
        H_R, recv_R = placement_loads(counts_RE, placement)
        return a2a_chunks(self.comm_costs, float(recv_R.max()) * self.token_bytes, float(H_R.max()))[0]

    def on_start(self, trainer: Trainer) -> None:
        if self.costs is None:
            assert self._measure is not None, "ExpertParallelHook needs costs or a way to measure them"
            self._set_costs(self._measure())  # collective: every rank of the EP group measures together
        if self.comm_costs is None and self._measure_comm is not None:
            self.comm_costs = self._measure_comm(self.costs)  # collective as well
        if self.comm_costs is not None:
            R = self._uniform.shape[0]  # one exchange under balanced routing: the rows that leave the rank
            a2a_s = self._uniform.sum(axis=1).max() * (R - 1) / R * self.token_bytes / self.comm_costs.a2a_bandwidth
            self.ep.set_chunk_bytes(_chunk_bytes(self.sc, self.comm_costs, self.ep.grads.reduced_bytes, a2a_s))
        if self.chunks is None:
            self.chunks = [self._chunks_for(self._uniform, plc) for plc in self.placements]
        if self.ctx.is_main:
            path = trainer.run_dir / "plans.jsonl"
            MetricsLog.truncate_after(path, trainer.step)  # a resumed run re-plans the steps after its checkpoint
            self._log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_end
        if self.sc.events:
            path = trainer.run_dir / "comm" / f"rank{self.ep.dims.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            MetricsLog.truncate_after(path, trainer.step)
            self._events = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in on_end

    def before_step(self, trainer: Trainer, step: int) -> None:
        self.sched.log.begin(step)
        self.sched.start_compute()  # the emulated device's clock (scheduler.dilate) starts with the step
        for d, c in zip(self.ep.dispatchers, self.chunks or []):
            d.a2a_chunks = c
        self.ep.apply(self.placements)  # Trans (all layers now, or layer 0 now and the rest overlapped)

    def after_backward(self, trainer: Trainer, step: int) -> None:
        self.ep.aggregate()  # Agg, before the optimizer step
        self.ep.sync_gradients()  # waits for the chunks still in flight
        self._t_opt = time.perf_counter()

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        """Keep each rank's counts (the planner's R x E matrix) and return the statistics summed over the
        stage's ranks: one all-gather of every layer's packed statistics over "dp_ep" (it holds the "ep"
        group's rows too) and one host read of the expert-parallel group's counts."""
        dims = self.ep.dims
        packed_LX = torch.stack([s.packed() for s in stats])
        gathered = [torch.empty_like(packed_LX) for _ in range(dims.size("dp_ep"))]
        self.sched.run("stats", lambda: dist.all_gather(gathered, packed_LX, group=dims.group("dp_ep"),
                                                        async_op=True),
                       name="routing stats", nbytes=packed_LX.numel() * packed_LX.element_size() * len(gathered))
        all_WLX = torch.stack(gathered)
        E = stats[0].counts_E.numel()
        members = dims.ranks_of("dp_ep")
        rows = [members.index(r) for r in dims.ranks_of("ep")]
        counts_RLE = np.asarray(to_host(all_WLX[rows, :, :E], "placement counts"), dtype=np.float64)
        self._counts_RE = [np.ascontiguousarray(counts_RLE[:, i]) for i in range(len(stats))]
        summed_LX = all_WLX.sum(dim=0)
        return [RoutingStats.unpack(summed_LX[i], E) for i in range(len(stats))]

    def after_step(self, trainer: Trainer, step: int, stats: list[RoutingStats], record: dict[str, Any]) -> None:
        self.ep.release()  # replicas hold pre-update weights; validation and the next Trans must not see them
        self.sched.log.span("compute", "optimizer", self._t_opt)
        used = self.placements
        metrics = [placement_metrics(c, p, self.costs) for c, p in zip(self._counts_RE, used)]
        self.placements = [pl.step(c) for pl, c in zip(self.planners, self._counts_RE)]
        used_chunks = list(self.chunks or [])
        self.chunks = [self._chunks_for(c, p) for c, p in zip(self._counts_RE, self.placements)]
        record["rank_imbalance_before"] = [round(m["imbalance_before"], 4) for m in metrics]
        record["rank_imbalance_after"] = [round(m["imbalance_after"], 4) for m in metrics]
        record["replicas"] = [p.num_replicas for p in used]
        record["trans_bytes"] = int(sum(m["trans_bytes"] for m in metrics))
        record["a2a_bytes"] = int(sum(m["a2a_bytes"] for m in metrics))
        record["plan_ms"] = round(1e3 * sum(pl.last.get("plan_s", 0.0) for pl in self.planners), 3)
        record["a2a_chunks"] = used_chunks
        self._record_comm(trainer, step, record)
        if self._log is not None:
            line = {"step": step, "counts": [c.astype(int).tolist() for c in self._counts_RE],
                    "used": [p.to_dict() for p in used], "next": [p.to_dict() for p in self.placements],
                    "metrics": metrics, "a2a_chunks": used_chunks}
            self._log.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._log.flush()

    def _record_comm(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        """The step's communication: means over ranks into the metrics record, this rank's events into its log
        file, and on `scheduler.trace_step` a Chrome trace of every rank (gathered on rank 0)."""
        comm = self.sched.log.end()
        line = step_record(comm, self.ep.dims.rank)
        vals = self.ctx.sum([comm.exposed_s, comm.a2a_s, comm.allreduce_s, comm.placement_s, comm.a2a_shared_s,
                             comm.held_s])
        n = self.ep.dims.size("dp_ep")
        for key, v in zip(("exposed_comm_s", "a2a_s", "allreduce_s", "placement_comm_s", "a2a_shared_s", "held_s"),
                          vals):
            record[key] = round(v / n, 6)
        record["comm_window_s"] = round(comm.step_s, 6)  # from Trans to the step's bookkeeping, this rank
        if self._events is not None:
            self._events.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._events.flush()
        if step == self.sc.trace_step:
            gathered: list[Any] = [None] * self.ep.dims.world_size
            dist.all_gather_object(gathered, line)
            if self.ctx.is_main:
                write_chrome_trace(gathered, trainer.run_dir / "comm_trace.json")

    def on_end(self, trainer: Trainer) -> None:
        for f in (self._log, self._events):
            if f is not None:
                f.close()
        self._log = self._events = None

    def state_dict(self) -> dict[str, Any]:
        """Planner forecasts, the placements and token chunks of the next step and measured coefficients, so a
        resumed run plans what the uninterrupted run would have (placements and chunks change only summation
        order, but resume is bitwise)."""
        from moebal.distributed.calibrate import costs_to_dict

        return {"placements": [p.to_dict() for p in self.placements],
                "planners": [{"forecast": None if pl.forecast_RE is None else pl.forecast_RE.tolist(),
                              "observed": pl.observed, "current": pl.current.to_dict()} for pl in self.planners],
                "measured_costs": costs_to_dict(self.costs) if self._measure is not None else None,
                "comm_costs": self.comm_costs.to_dict() if self._measure_comm and self.comm_costs else None,
                "a2a_chunks": self.chunks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        from moebal.distributed.calibrate import costs_from_dict

        placements = [ExpertPlacement.from_dict(d) for d in state["placements"]]
        if len(placements) != len(self.planners) or any(p.num_ranks != self.ep.dims.size("ep") for p in placements):
            return  # a checkpoint of another expert-parallel size: plan afresh (and measure this layout's costs)
        self.placements = placements
        for pl, s in zip(self.planners, state["planners"]):
            pl.forecast_RE = None if s["forecast"] is None else np.asarray(s["forecast"], dtype=np.float64)
            pl.observed = int(s["observed"])
            pl.current = ExpertPlacement.from_dict(s["current"])
        if self._measure is not None and state.get("measured_costs"):
            self._set_costs(costs_from_dict(state["measured_costs"]))  # no re-measurement: the same plans
        if self._measure_comm is not None and state.get("comm_costs"):
            self.comm_costs = CommCosts(**state["comm_costs"])
        if state.get("a2a_chunks"):
            self.chunks = [int(c) for c in state["a2a_chunks"]]


def setup_parallel(cfg: Config, load_weights: bool = True, run_dir: Path | None = None,
                   resume: bool = False) -> tuple[RunContext, torch.nn.Module, list[Hook]]:
    """Join the job described by the torchrun environment and build this rank's model and hooks.

    With `scheduler.expert_packing: lina` the expert-parallel size is chosen first (measured on the job, or
    read from `run_dir`'s packing.json when the run `resume`s; moebal/balance/packing.py).

    The full model is built on every rank from the run's seed, so it equals the single-process model, then
    expert parallelism keeps this rank's experts; from `hf.init_from` (unless `load_weights` is false because a
    checkpoint will overwrite it) each rank reads the shared weights and its own experts only. The planner's
    coefficients come from `planner.costs`, the communication scheduler's from the same source (measured on
    the job, or the hardware profile).
    """
    from moebal.models import build_model
    from moebal.train.trainer import seed_everything

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = cfg.parallel.pp
    if pp != 1:
        raise ConfigError("parallel.pp > 1 runs the pipeline engine (moebal.pipeline); this entry point builds "
                          "data and expert parallelism only")
    ep = cfg.parallel.ep or world
    if cfg.scheduler.expert_packing != "off" and world > 1 and cfg.moe.num_experts:
        from moebal.balance.packing import choose_expert_parallel

        rank, _, local = env_world()
        ep = choose_expert_parallel(cfg, world, rank, pick_device(local), min(ep, cfg.moe.num_experts), run_dir,
                                    resume)
    if cfg.moe.num_experts and cfg.moe.num_experts % ep:
        raise ConfigError(f"moe.num_experts ({cfg.moe.num_experts}) is not divisible by the expert-parallel size "
                          f"{ep}: set parallel.ep (--ep) to a divisor of it")
    if cfg.moe.num_experts == 0:
        ep = 1
    dims = ParallelDims.from_env(ep=ep, pp=pp).init(timeout_s=60.0 * cfg.parallel.timeout_min)
    refuse_cpu_only(cfg, dims.device.type)
    ctx = RunContext(dims)
    seed_everything(cfg.train.seed)
    if cfg.hf.init_from and load_weights and dims.distributed and ep > 1 and cfg.moe.num_experts:
        # Each rank reads only its own experts from the checkpoint: a rank never holds the whole model.
        from moebal.interop.hf import from_hf
        from moebal.planner.plan import default_owners

        owners, r = default_owners(cfg.moe.num_experts, ep), dims.index("ep")
        model = from_hf(cfg.hf.init_from, cfg=cfg, device=dims.device,
                        experts=[e for e, o in enumerate(owners) if o == r])
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

        expert_parallel = ExpertParallel(model, dims, sched, overlap=sc.block_overlap,
                                         compute_dtype=autocast_dtype(cfg, dims.device))
        ctx.comm = sched
        hooks.append(_expert_parallel_hook(cfg, expert_parallel, dims, ctx))
    elif dims.distributed:
        hooks.append(DataParallelHook(dims))
    return ctx, model, hooks


def _expert_parallel_hook(cfg: Config, ep: ExpertParallel, dims: ParallelDims, ctx: RunContext) -> ExpertParallelHook:
    """The hook with its planner and scheduler coefficients: from a hardware profile now, or measured on the
    job when training starts (`planner.costs: measure`) unless a resumed checkpoint holds the run's
    measurement."""
    tokens = cfg.data.batch_size * cfg.data.seq_len // dims.size("dp_ep")
    if cfg.planner.costs == "measure":
        from moebal.distributed.calibrate import measure_comm_costs, measure_layer_costs

        return ExpertParallelHook(
            ep, cfg, None, ctx, measure=lambda: measure_layer_costs(ep.dispatchers[0], tokens * cfg.moe.top_k,
                                                                    dilate=cfg.scheduler.dilate),
            measure_comm=lambda layer: measure_comm_costs(ep.dispatchers[0], dims.group("dp_ep"),
                                                          tokens * cfg.moe.top_k, layer, dilate=cfg.scheduler.dilate))
    from moebal.planner.comm_plan import comm_costs_from_profile
    from moebal.planner.cost import CostModel, ModelShape

    cost = CostModel(cfg.planner.costs)
    costs = cost.moe_layer_costs(ModelShape.from_config(cfg), dims.ranks_of("ep"), tokens, cfg.data.seq_len)
    comm = comm_costs_from_profile(cost, costs, dims.ranks_of("ep"), dims.ranks_of("dp_ep"))
    return ExpertParallelHook(ep, cfg, costs, ctx, comm_costs=comm)


def _chunk_bytes(sc: Any, comm_costs: CommCosts, total_bytes: float, a2a_s: float) -> float:
    """Gradient chunk: ddp's bucket, `scheduler.chunk_mb`, or the cost model's (`ar_chunk_bytes`)."""
    from moebal.planner.comm_plan import ar_chunk_bytes

    if sc.mode == "ddp":
        return sc.bucket_mb * 1e6
    return sc.chunk_mb * 1e6 if sc.chunk_mb else ar_chunk_bytes(comm_costs, total_bytes=total_bytes, a2a_s=a2a_s)


class DataParallelHook(Hook):
    """Plain data parallelism (a dense model, or experts replicated): average every gradient over the ranks."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims

    def after_backward(self, trainer: Trainer, step: int) -> None:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        sum_gradients(params, self.dims.group("dp_ep"), self.dims.size("dp_ep"))

    def reduce_stats(self, trainer: Trainer, stats: list[RoutingStats]) -> list[RoutingStats]:
        return sum_stats(stats, self.dims.group("dp_ep"))


def sum_stats(stats: list[RoutingStats], group: Any, sched: CommScheduler | None = None) -> list[RoutingStats]:
    """Routing statistics summed over the ranks of `group` with one all-reduce of every layer's packed
    statistics (copies; the inputs stay local)."""
    if not stats:
        return []
    packed_LX = torch.stack([s.packed() for s in stats])
    if sched is not None:
        sched.all_reduce(packed_LX, group, name="routing stats")
    else:
        dist.all_reduce(packed_LX, group=group)
    E = stats[0].counts_E.numel()
    return [RoutingStats.unpack(packed_LX[i], E) for i in range(len(stats))]
