"""One rank's pipeline step; the layer balancer (`balance/layers.py`) observes, plans and applies.

The trainer (`moebal.train.Trainer`) runs it as its step strategy (`moebal/train/pipelined.py`): validation,
the time limit, metrics, checkpoints and the summary are the trainer's. `PipelineRunner.train` runs bare
steps without them (tests and benchmarks that compare the engine with a reference).

Per step (every rank of every pipeline runs the same sequence):
  1. read the global batch (every rank reads the same one; a data-parallel replica keeps its rows) and
     count its labels, so micro-batch losses add up to the single-process mean loss;
  2. the engine runs the stage's forward and backward (`engine.py`); on profiled steps it also times every
     layer and counts its activation bytes (`observe.py`);
  3. the dynamism scheme sees the gradients (pruning masks them, freezing reads them);
  4. data-parallel gradient sum, one all-reduce per layer over the "dp" group: a layer's bucket has the same
     layout wherever the layer sits, so the sum is the same with or without migrations;
  5. one small all-reduce along the chain: per-slot squared gradient norms, per-layer auxiliary losses,
     the loss, each stage's busy and run time; the global norm is summed over slots in model order, so
     clipping is bit-identical under any partition;
  6. clip, AdamW step, the scheme's post-step work and its end-of-step decisions (prune, freeze, ...);
  7. the layer balancer's step (`LayerBalancer.step`): on profiled steps it folds the profile into the
     smoothed costs, checks the partition under trial against the one it replaced (migrating back when it
     measures slower), plans (partition by time or diffusion, then re-packing onto fewer ranks) and migrates;
     released ranks stop here and report `released`.
Rank order of a pipeline (`PipeChain`) comes from `ParallelDims.ranks_of("pp")`; after a re-pack it is the
surviving subsequence. Data-parallel replicas take identical decisions from identical (averaged) inputs.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moebal.balance.experts import StageExperts, placed_imbalance, stage_metrics, stage_routing
from moebal.balance.layers import LayerBalancer, expand_repack
from moebal.config import Config, refuse_cpu_only
from moebal.data import DocumentSampler, PackedSampler, ordering_sampler
from moebal.data.curriculum import row_complexity
from moebal.distributed.expert_parallel import is_expert_param
from moebal.distributed.fsdp import DTYPES, DeferredGradReducer, StageShardedAdamW, StepHold, stage_mesh, stage_units
from moebal.distributed.groups import ParallelDims
from moebal.distributed.sharded import ShardedAdamW
from moebal.dynamism.scheme import Dynamism, SchemeContext
from moebal.errors import ConfigError
from moebal.models import noise
from moebal.pipeline.engine import IterationResult, PipelineEngine
from moebal.pipeline.migrate import WholeState, rebuild_optimizer
from moebal.pipeline.observe import pick_clock
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage
from moebal.pipeline.tied import TiedEmbedding, wire_dtype
from moebal.pipeline.units import UnitMap
from moebal.planner.partition import imbalance, partition_by_params, partition_uniform
from moebal.sync import to_host
from moebal.train.precision import uses_bf16

if TYPE_CHECKING:
    from moebal.data import DataBundle
    from moebal.models.local_init import InitProgram
    from moebal.models.transformer import MoebalForCausalLM

__all__ = ["BALANCERS", "Forced", "PipelineRunner", "RunSummary", "expand_repack", "pipeline_ep"]

BALANCERS = ("off", "partition", "diffusion")

Forced = Sequence[tuple[int, Sequence[int]]]
"""(step, sizes) pairs: partitions adopted at given steps whatever the planner says (tests, experiments)."""


@dataclass
class RunSummary:
    """What one rank's run returns."""

    rank: int
    released: bool
    released_at: int | None
    records: list[dict[str, Any]]
    plans: list[dict[str, Any]]
    final_sizes: list[int]
    gantt: dict[str, list[list[float]]] = field(default_factory=dict)
    """'before'/'after': rows of (stage, kind 0=F 1=B, micro-batch, start, end) for one iteration."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def pipeline_ep(cfg: Config, world_size: int) -> int:
    """Expert-parallel size of a pipeline run: `parallel.ep`, or when null every rank of a stage for an MoE
    model (world / pp), and 1 for a dense model (the other ranks of a stage are data-parallel replicas)."""
    if cfg.parallel.ep is not None:
        return cfg.parallel.ep
    if cfg.moe.num_experts == 0:
        return 1
    return max(1, world_size // max(cfg.parallel.pp, 1))


def refuse_layout(cfg: Config, ep: int) -> None:
    """The refusals of a pipeline layout that need no process group: every rank's runner makes them, and
    `moebal train --nproc N` before it starts any rank (`ep`: `pipeline_ep` of the job)."""
    E, L, pp = cfg.moe.num_experts, cfg.model.n_layers, cfg.parallel.pp
    if ep > 1 and (E == 0 or E % ep):
        raise ConfigError(f"parallel.ep = {ep} needs MoE layers whose moe.num_experts ({E}) it divides: choose a "
                          f"divisor of it, or ep=1")
    if pp > L:
        raise ConfigError(f"{pp} pipeline stages for {L} layers: every stage needs a layer; use at most {L} stages")


class PipelineRunner:
    """Builds this rank's stage from the model; `train_step` trains one step, `evaluate` validates."""

    def __init__(self, cfg: Config, *, scheme: Dynamism | None = None, dims: ParallelDims | None = None,
                 data: DataBundle | None = None, run_dir: str | Path | None = None, device: torch.device | None = None,
                 force: Forced = (), force_mid: Forced = (), record_ops: bool = True, bandwidth: float | None = None,
                 latency: float = 1e-4) -> None:
        """Build this rank's stage of `cfg` (its `pipeline` section says how the pipeline runs and rebalances).

        Experiment and test knobs: `force` adopts (step, sizes) after that step whatever the planner says (fewer
        sizes than stages re-packs); `force_mid` migrates between that step's backward and its optimizer step
        (gradients travel too); `record_ops` keeps one iteration's per-op timeline before and after each adopted
        plan (the Gantt chart); `bandwidth` (bytes/s) costs migrations instead of measuring the chain at start;
        `latency` is the seconds per migrated layer beyond its bytes."""
        from moebal.train.memory import settle_shard

        cfg = settle_shard(cfg, device)  # parallel.shard auto: the memory plan's choice, as `moebal train`'s
        self.cfg, self.opts = cfg, cfg.pipeline
        self.force, self.force_mid = tuple(force), tuple(force_mid)
        self.record_ops, self.latency = record_ops, latency
        self.scheme = scheme or Dynamism()
        self.device = device or torch.device("cpu")
        refuse_cpu_only(cfg, self.device.type)
        if dims is None:
            dims = ParallelDims(world_size=dist.get_world_size(), rank=dist.get_rank(), pp=cfg.parallel.pp,
                                ep=pipeline_ep(cfg, dist.get_world_size()), device=self.device).init(
                60.0 * cfg.parallel.timeout_min)
        refuse_layout(cfg, dims.ep)
        self.dims, self.L = dims, cfg.model.n_layers
        self.chain = PipeChain(dims.ranks_of("pp"), dims.rank, self.opts.wait, groups=dims.pipe_groups())
        self.P0 = self.chain.size
        self.dp_group, self.dp = dims.group("dp"), dims.dp
        # the ranks of one stage ("dp_ep": data-parallel replicas x expert shards) split each batch's rows
        self.stage_group, self.data_ranks, self.data_index = dims.group("dp_ep"), dims.size("dp_ep"), \
            dims.index("dp_ep")
        self.ep_group = dims.group("ep")
        self.data = data if data is not None else _build_data(cfg)
        self.step = 0
        self.units = self._unit_map(cfg)
        self.U = self.units.size
        """Partition units (`units.py`): what costs, sizes, migrations and gradient-norm slots count; L layers
        when no layer is split."""
        self._build(cfg)
        self.records: list[dict[str, Any]] = []
        self.released_at: int | None = None
        self._routing_sample: torch.Tensor | None = None  # `_gather_routing`: rank 0's, until taken
        self._complexity: dict[int, torch.Tensor] = {}  # data.order complexity: per forward, [rows, stage MoE layers]
        self._row_tokens: list[int] = []
        self._row_index = self._last_index = torch.zeros(0, dtype=torch.int64)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._scheme_resumed = False
        self.balancer = LayerBalancer(self, cfg.pipeline.feedback, bandwidth=bandwidth)
        """Observe, plan, apply and check at the layer granularity (`balance/layers.py`)."""

    # ---- construction ----
    def _unit_map(self, cfg: Config) -> UnitMap:
        """Whole layers, or with `split_layers` every dense layer the scheme lets split (`Dynamism.splittable`) in
        two halves."""
        if not self.opts.split_layers:
            return UnitMap.whole(self.L)
        return UnitMap.build(self.L, [i for i in range(self.L)
                                      if not cfg.is_moe_layer(i) and self.scheme.splittable(i)])

    def _build(self, cfg: Config) -> None:
        from moebal.models.local_init import meta_model
        from moebal.train.trainer import seed_everything

        seed_everything(cfg.train.seed)
        model, program = meta_model(cfg)  # the full model on the meta device: nothing allocated yet
        if self.opts.initial == "params":
            probe = copy.deepcopy(model)  # the scheme's structural changes count (meta: no memory)
            self.scheme.prepare_model(probe)
            counts = [sum(p.numel() for p in layer.parameters()) for layer in probe.model.layers]
            layer_sizes = partition_by_params(counts, self.P0,
                                              first_extra=float(probe.model.embed_tokens.weight.numel()),
                                              last_extra=float(probe.lm_head.weight.numel()))
        else:
            layer_sizes = partition_uniform(self.L, self.P0)
        self.sizes = self.units.unit_sizes(layer_sizes)  # the initial partition keeps layers whole
        p = self.chain.index
        start = sum(self.sizes[:p])
        model = self._materialise(cfg, model, program, list(range(start, start + self.sizes[p])))
        self.scheme.prepare_model(model)
        self.stage = PipelineStage.from_model(model, start, start + self.sizes[p], self.chain.is_first,
                                              self.chain.is_last, self.units).to(self.device)
        del model
        # model.tie_embeddings across stages: the first stage's embedding is the weight, the last stage's head a
        # copy that follows it; on one fully sharded stage the head a copy too (`tied.py`)
        untie = cfg.parallel.shard == "full" and self.dims.distributed
        self.tied = TiedEmbedding.of(self.stage, self.chain, wire_dtype(cfg), untie=untie)
        self.experts = StageExperts(self.stage, self.dims, cfg)
        # sharded AdamW state (`parallel.shard: optimizer`): its communicators are made once, here, on every rank
        # (a rebuild after a migration reuses them: released ranks could not join a new group's creation)
        self._shard_channels = ShardedAdamW.make_channels(self.dims) if cfg.parallel.shard == "optimizer" else None
        # fully sharded state (`parallel.shard: full`): the stage's FSDP2 mesh, made once on every rank too; a
        # single process (a scheme's one-stage pipeline) has nothing to shard over and trains as the trainer
        # without a pipeline does there, unsharded
        self._fsdp_mesh = stage_mesh(self.dims) if cfg.parallel.shard == "full" and self.dims.distributed else None
        if self.tied is not None and self._fsdp_mesh is not None:  # the head's gradient into the embedding's shards
            self.tied.shard(self.stage, self._fsdp_mesh, DTYPES[cfg.parallel.reduce_dtype])
        # and what FSDP2 holds through a step there (parallel.accumulate whole, parallel.reshard step): the stage's
        # units as they are when a step runs (migrations change them), each built to reshard after its forward
        self._step_hold = (StepHold.of(cfg, lambda: stage_units(self.stage), lambda m: True)
                           if self._fsdp_mesh is not None else None)
        # and, with expert parallelism inside the stages, the expert optimizer's communicators (made once too)
        self._expert_channels = (ShardedAdamW.make_channels(self.dims)
                                 if self._fsdp_mesh is not None and self.dims.ep > 1 else None)
        # a scheme whose per-layer decisions the stage's ranks must take alike under FSDP2 agrees on its own channel
        self._lockstep_channel = (self.dims.new_channel("dp_ep") if self._fsdp_mesh is not None
                                  and self.scheme.lockstep_decisions and self.data_ranks > 1 else None)
        self.optimizer: torch.optim.Optimizer | None = self._make_optimizer(self.stage)
        autocast = None
        if uses_bf16(cfg, self.device):
            def autocast() -> Any:
                return torch.autocast(self.device.type, dtype=torch.bfloat16)
        self.engine = PipelineEngine(self.stage, self.chain, self.scheme, self.opts.schedule,
                                     self._num_micro(), autocast, aux_ranks=self.data_ranks)  # capped at the rows
        self.engine.dilate = self.opts.dilate
        if self._fsdp_mesh is not None:  # zero bubble: W's gradients of FSDP2 shards are reduce-scattered by hand
            self.engine.wgrad.reducer = DeferredGradReducer(self.stage, self._fsdp_mesh,
                                                            DTYPES[cfg.parallel.reduce_dtype])
        elif self._shard_channels is not None and cfg.parallel.param_dtype != "fp32":
            self.engine.wgrad.reducer = _SumsOfCopies(self)  # zero bubble: W's gradients of bf16 copies in fp32
        self.clock = pick_clock(self.device)
        ctx = self._ctx()
        ctx.rows, ctx.device = self._micro_rows() * cfg.data.seq_len, self.device
        self.scheme.on_start(ctx)

    def _materialise(self, cfg: Config, model: MoebalForCausalLM, program: InitProgram,
                     units: list[int]) -> MoebalForCausalLM:
        """This rank's part of the meta-built model for real (moebal/models/local_init.py): its stage's layers,
        the embedding on the first stage, the norm and head on the last, and its experts' rows under expert
        parallelism; from `hf.init_from` (only those tensors are read) or the seeded random initialisation."""
        from moebal.models.local_init import Holding, materialise
        from moebal.planner.plan import default_owners

        experts = None
        if self.dims.ep > 1:
            owners = default_owners(cfg.moe.num_experts, self.dims.ep)
            experts = tuple(e for e, o in enumerate(owners) if o == self.dims.index("ep"))
        tied_head = cfg.model.tie_embeddings and self.chain.is_last  # its weight is the embedding's tensor
        holding = Holding(layers=frozenset(self.units.layers_of(units)), embed=self.chain.is_first or tied_head,
                          head=self.chain.is_last, experts=experts)
        if cfg.hf.init_from:
            from moebal.interop.hf import from_hf

            return from_hf(cfg.hf.init_from, cfg=cfg, holding=holding)
        materialise(model, program, holding)
        return model

    def _micro_rows(self) -> int:
        rows = max(1, self.cfg.data.batch_size // self.data_ranks)
        return max(1, rows // min(self.opts.micro_batches, rows))

    def _make_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer | None:
        """AdamW as the single-process trainer builds it, or its sharded form over the stage's ranks
        (`parallel.shard: optimizer`: dense state over "dp_ep", expert state over "dp"; the losses are normalised
        by the global label count already, so the reduced gradients are sums: divisor 1; a scheme that may leave a
        parameter without a gradient gives it a step count per parameter, `skips`); None when nothing here trains
        (a frozen stage)."""
        from moebal.train.optim import build_optimizer

        if not any(p.requires_grad for p in module.parameters()):
            return None
        copy = self.tied.copy if self.tied is not None else None  # a tied head's copy follows the embedding
        if self._shard_channels is not None:  # bf16 weights: the micro-batches' gradients summed in fp32
            par = self.cfg.parallel
            return ShardedAdamW(module, self.cfg.train, self.dims, divisor=1.0, channels=self._shard_channels,
                                param_dtype=DTYPES[par.param_dtype], reduce_dtype=DTYPES[par.reduce_dtype],
                                accumulate=True, skips=self.scheme.idle_parameters(),
                                include=None if copy is None else (lambda p: p is not copy))
        if self._fsdp_mesh is not None:  # `parallel.shard: full`: shards the stage's layers (again) first
            assert isinstance(module, PipelineStage)
            return StageShardedAdamW(module, self.cfg, self.dims, self._fsdp_mesh, self._expert_channels,
                                     prepare_layer=self.scheme.prepare_layer, skip=[copy] if copy is not None else [])
        return build_optimizer(module, self.cfg.train, skip=[copy] if copy is not None else [])

    @property
    def sharded(self) -> ShardedAdamW | None:
        """The sharded optimizer (`parallel.shard: optimizer`), None when the state is whole."""
        return self.optimizer if isinstance(self.optimizer, ShardedAdamW) else None

    def _ctx(self) -> SchemeContext:
        return SchemeContext(step=self.step, stage=self.stage, chain=self.chain, num_layers=self.L,
                             optimizer=self.optimizer, dp_group=self.dp_group, dp=self.dp, ep=self.dims.ep,
                             ep_index=self.dims.index("ep"),
                             shard_sum=self.experts.shard_sum,
                             stage_sum=self._stage_sum if self._lockstep_channel is not None else None,
                             whole_sums=self._step_hold is not None and self._step_hold.whole_sums)

    def _last_pass(self, on: bool) -> None:
        """The engine's `last_pass`: Agg's hooks inside the last backward (block overlap), and the scheme's
        (`Dynamism.last_pass`: FSDP2's whole sums go out in that backward)."""
        self.experts.last_pass(on)
        self.scheme.last_pass(on)

    def _stage_sum(self, v: torch.Tensor) -> torch.Tensor:
        """`v` summed over the ranks of this stage on the scheme's channel (a host tensor: gloo)."""
        dist.all_reduce(v, group=self._lockstep_channel)
        return v

    def _follow_trainable(self) -> None:
        """After the scheme stopped parameters (freezing): a sharded optimizer is rebuilt over the parameters that
        still train, as a migration rebuilds it (`rebuild_optimizer`; the parameters that stay keep their state).
        Its flats would otherwise step a frozen parameter with a zero gradient (moments and weight decay move
        it), where torch's AdamW skips a parameter without a gradient. Collective over the stage (`full_state`);
        nothing when the optimizer is torch's or the trainable set did not change."""
        opt = self.optimizer
        gather = getattr(opt, "full_state", None)
        if opt is None or gather is None:
            return
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        copy = self.tied.copy if self.tied is not None else None  # never the optimizer's (`tied.py`)
        if held == {id(p) for p in self.stage.parameters() if p.requires_grad and p is not copy}:
            return
        walk = WholeState(gather(), opt.param_groups)
        getattr(opt, "close", lambda: None)()
        self.optimizer = rebuild_optimizer(self.stage, walk, {}, self._make_optimizer)

    # ---- the loop ----
    def train(self, steps: int) -> RunSummary:
        """Run bare steps until `steps` (1-based step count) or until this rank is released: no validation,
        metrics file or checkpoint (the trainer's), for tests and benchmarks."""
        self.start()
        try:
            while self.step < steps and not self.released:
                with noise.step_key(self.cfg.train.seed, self.step + 1):  # as the trainer keys router noise
                    self.train_step()
            return self.summary()
        finally:
            self.close()

    def close(self) -> None:
        """Release this runner's communication resources (the spin board)."""
        self.chain.close()

    def start(self) -> None:
        """Measure the links when planning needs them (collective along the chain); `train` calls it."""
        self.balancer.start()

    @property
    def released(self) -> bool:
        return self.released_at is not None

    def summary(self) -> RunSummary:
        self.chain.flush()
        return RunSummary(rank=self.dims.rank, released=self.released, released_at=self.released_at,
                          records=self.records, plans=self.plans, final_sizes=list(self.sizes), gantt=self.gantt)

    @property
    def plans(self) -> list[dict[str, Any]]:
        """Every plan and verdict of the layer balancer (the run's plans.jsonl)."""
        return self.balancer.plans

    @property
    def gantt(self) -> dict[str, list[list[float]]]:
        """'before'/'after' the first adopted plan: one iteration's ops per stage (`LayerBalancer.keep_gantt`)."""
        return self.balancer.gantt

    def after_migration(self) -> None:
        """Called on every rank after the balancer moved layers (the partition in `sizes` is the new one)."""

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor, int, list[int], torch.Tensor | None]:
        """The next training batch, split as `_rows` splits it."""
        batch = self.data.train.next_batch()
        out = self._rows(batch)
        if self._curriculum() is not None:  # what the step's curriculum rows are recorded against
            self._row_tokens = (batch.labels_BT != -100).sum(dim=1).tolist()
            self._row_index = self._last_index
        return out

    def _rows(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int, list[int], torch.Tensor | None]:
        """This rank's rows of the global batch, the batch's label count, this rank's rows per micro-batch and
        each of its rows' real tokens (host int64, the schemes' `ROW_TOKENS`; None when no row of the batch is
        padded: packed samples). The loader pads on the right and labels only padding -100, so a row's real
        tokens are its labels.

        Micro-batch-major split: the global batch is cut into the M micro-batches first, and the ranks of a stage
        (data-parallel replicas x expert shards) split each micro-batch's rows. So global micro-batch j holds the
        same rows under every data-parallel size that gives each rank a row of every micro-batch
        (pipeline.micro_batches <= data.batch_size / ranks; beyond that the count is capped at that quotient,
        which depends on the layout), and what is not linear in the tokens (the load-balancing loss from a
        micro-batch's summed routing statistics) is the same too: a resume under another such layout keeps the
        maths. (Splitting the batch by rank first would group rows into micro-batches by layout.)
        """
        ids, labels = batch.ids_BT, batch.labels_BT
        count = int((labels != -100).sum())
        n = self.data_ranks
        self.check_rows(ids.shape[0])
        M = max(1, min(self._num_micro(), ids.shape[0] // n))  # every rank gets a row of every micro-batch
        mine = [torch.tensor_split(rows, n)[self.data_index]
                for rows in torch.tensor_split(torch.arange(ids.shape[0]), M)]
        self._last_index = index = torch.cat(mine)  # global row of each of this rank's rows (the curriculum's)
        real_B = (labels[index] != -100).sum(dim=1) if count < labels.numel() else None  # host: no sync
        return ids[index].to(self.device), labels[index].to(self.device), count, [len(x) for x in mine], real_B

    def check_rows(self, rows: int) -> None:
        """A batch of `rows` rows can be split over this stage's ranks (each needs a row); ConfigError otherwise.
        Training batches are checked with the config; a validation set may be smaller than one batch, so the
        trainer checks its batches at the start too (`PipelineStep.start`), not at the first validation."""
        n = self.data_ranks
        if rows < n:
            raise ConfigError(f"a batch of {rows} rows (data.batch_size {self.cfg.data.batch_size}; a validation "
                              f"set smaller than one batch) is split over the {n} ranks of a pipeline stage "
                              "(data-parallel x expert-parallel), and every rank needs a row: hold out more "
                              "(data.val_fraction, data.max_bytes) or set data.val_fraction 0")

    def _num_micro(self) -> int:
        return min(self.opts.micro_batches, max(1, self.cfg.data.batch_size // self.data_ranks))

    def _stage_mean(self, v: torch.Tensor) -> torch.Tensor:
        """Mean over the ranks of this stage (replicas and expert shards): what every pipeline plans from."""
        if self.data_ranks > 1:
            dist.all_reduce(v, group=self.stage_group)
            v /= self.data_ranks
        return v

    def _next_input(self) -> tuple[Any, int]:
        """This step's input for the engine and the global batch's label count."""
        ids, labels, count, sizes, real_B = self._batch()
        return (ids, labels, sizes, real_B), count

    def _forward_tokens(self, work: Any) -> list[int]:
        """This rank's tokens in each forward of the step, in run order (the engine's micro-batches)."""
        ids, _, sizes, _ = work
        M = min(self.engine.num_micro, ids.shape[0]) if sizes is None else len(sizes)
        rows = [len(t) for t in torch.tensor_split(torch.arange(ids.shape[0]), M)] if sizes is None else sizes
        return [r * ids.shape[1] for r in rows]

    def _run_engine(self, work: Any, count: int) -> IterationResult:
        ids, labels, sizes, real_B = work
        return self.engine.run(ids, labels, count, sizes, real_B)

    def train_step(self) -> dict[str, Any]:
        step = self.step + 1
        t0 = time.perf_counter()
        work, count = self._next_input()
        from moebal.train.optim import lr_at

        lr = lr_at(step - 1, self.cfg.train)
        self._set_lr(lr)
        profiled = self.balancer.profiled(step)
        self.scheme.begin_step(step)
        # Trans of the placed expert replicas (plan-ahead scales its first micro-batch's estimate to the step)
        self.experts.before_step(self._forward_tokens(work) if self.experts.ahead is not None else None)
        self.engine.profiler = self.balancer.profiler() if profiled else None
        self.engine.record_ops = self.record_ops
        self.engine.last_pass = self._last_pass
        self.engine.step_hold = self._step_hold  # whole sums, weights kept gathered: once per step each
        t_run = time.perf_counter()
        self.engine.on_forward = self._measure_rows if self._curriculum() is not None else None
        try:
            res = self._run_engine(work, count)
        finally:
            self.engine.on_forward = None
        t_run = time.perf_counter() - t_run
        self.step = step
        self.experts.after_backward()  # Agg of replica gradients; observe routing, plan the next placements
        self.scheme.after_backward(self._ctx())
        events: dict[str, Any] = {}
        for s, sizes in self.force_mid:
            if s == step:
                events.update(self.balancer.apply(list(sizes), "forced-mid", step, lr=lr))
        self._sync_grads()
        red = self._reduce(res, t_run)
        self._gather_routing(step)  # before the balancer: a migration must not take a layer's routing along
        self._record_complexity()
        measured_factors = self.balancer.factors()  # what this iteration ran at
        grad_norm = self._clip(red["sq"])
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.tied is not None:
            self.tied.share_weight()  # before a scheme may freeze the embedding (`Freezing`)
        self.scheme.after_optimizer_step(self._ctx())
        changed = self.scheme.update(self._ctx())
        if changed:
            self._follow_trainable()
        overhead = time.perf_counter()
        events.update(self.balancer.step(step, res, red, measured_factors, profiled))
        overhead = time.perf_counter() - overhead
        record = self._record(step, lr, count, red, grad_norm, time.perf_counter() - t0, overhead, profiled,
                              changed, events)
        self.records.append(record)
        return record

    def _gather_routing(self, step: int) -> None:
        """On a recording step (`train.record_routing_every`), the routing of the step's last micro-batch on the
        first data rank's tokens, as the trainer without a pipeline records it: each stage of that rank's chain
        sends its MoE layers' top-k expert ids to the first stage, which keeps them in model order until
        `take_routing_sample`. Every stage's last forward is the last micro-batch under 1F1B, GPipe and
        zero-bubble schedules (a recompute's replay leaves `last_routing` alone), so every layer's rows are the
        same tokens.
        Payload: 3 + L_s x T x K integers per stage, P - 1 messages, on recording steps only."""
        every = self.cfg.train.record_routing_every
        if not every or step % every or self.data_index != 0:
            return
        tokens = self._routed_tokens()
        if tokens is False:  # no micro-batch whose routing every stage holds (the same decision on every stage)
            return
        ids = [r.indices_TK for r in (layer.last_routing for layer in self.stage.moe_layers()) if r is not None]
        if ids:
            ids_LTK = torch.stack(ids)
            host = torch.tensor(to_host(ids_LTK.reshape(-1), "routing sample"), dtype=torch.int64).view(ids_LTK.shape)
            if tokens is not None:
                host = host[:, tokens]
            mine = torch.cat([torch.tensor(host.shape, dtype=torch.int64), host.reshape(-1)])
        else:  # a stage without MoE layers
            mine = torch.zeros(3, dtype=torch.int64)
        parts = self.chain.gather_1d(mine)
        if parts is None:
            return
        layers = [p[3:].view(*p[:3].tolist()) for p in parts if p[0] > 0]
        self._routing_sample = torch.cat(layers) if layers else None

    def _routed_tokens(self) -> torch.Tensor | bool | None:
        """Which tokens of the last forward's routing a sample records: None, all of them (the fixed
        micro-batches: every position is a token); the planned runner's real tokens, or False for none."""
        return None

    def _curriculum(self) -> PackedSampler | DocumentSampler | None:
        """The training sampler when it orders epochs by complexity (`data.order: complexity`); else None."""
        return ordering_sampler(self.data.train)

    def _measure_rows(self, j: int, labels_BT: torch.Tensor) -> None:
        """After F(j): each of this rank's rows' share of two-expert tokens in the stage's MoE layers (on the
        device; read once per step by `_record_complexity`)."""
        self._complexity[j] = row_complexity(self.stage.moe_layers(), labels_BT)

    def _record_complexity(self) -> None:
        """`data.order: complexity` (Adaptive Gating's curriculum): the step's per-row two-expert shares of every
        MoE layer into the sampler's table, the same on every rank. Each rank writes its rows (global row order)
        and its stage's layers (model order among the MoE layers) into a zero [B, MoE layers] host matrix; the
        sum over the stage's ranks and along the chain fills it exactly (each entry has one writer), as
        `RunContext.global_rows` does without a pipeline. One host read per step on a stage with MoE layers."""
        sampler = self._curriculum()
        if sampler is None or sampler.curriculum is None:
            return
        index, tokens, ids, at = self._complexity_rows(sampler)
        moe_ids = [i for i in range(self.L) if self.cfg.is_moe_layer(i)]
        cols = [moe_ids.index(i) for i in self.stage.layer_ids if self.stage.layer(i).is_moe]
        full = torch.zeros(len(tokens), len(moe_ids), dtype=torch.float64)
        if cols and self._complexity:
            local = torch.cat([self._complexity[j] for j in sorted(self._complexity)])
            vals = torch.tensor(to_host(local, "curriculum rows"), dtype=torch.float64).reshape(local.shape)
            full[index[:, None], torch.tensor(cols)[None, :]] = vals
        self._complexity.clear()
        if self.data_ranks > 1:
            dist.all_reduce(full, group=self.stage_group)  # a CPU tensor: gloo under the device-aware backend
        full = self.chain.allreduce_sum(full.reshape(-1)).reshape(full.shape)
        sampler.curriculum.record(ids, full.numpy(), tokens, at=at)

    def _complexity_rows(self, sampler: PackedSampler | DocumentSampler) -> tuple[torch.Tensor, list[int], list[int],
                                                                                    int]:
        """What the step's measured rows are recorded against: the batch row of each (in the order of the
        micro-batches measured, `_complexity`'s), the tokens of every batch row, their sample ids, and the
        sampler position after the batch."""
        return self._row_index, self._row_tokens, sampler.last_ids, sampler.position

    def take_routing_sample(self) -> torch.Tensor | None:
        """The last recording step's routing sample (int64 [L, T, K], every MoE layer in model order) on the chain's
        first stage of the first data rank, then None until the next recording step; None elsewhere."""
        sample, self._routing_sample = self._routing_sample, None
        return sample

    # ---- validation ----
    @torch.no_grad()
    def evaluate(self, batches: Sequence[Any]) -> tuple[float, float]:
        """Summed token cross-entropy and label count of `batches` (global batches, split as in training),
        forward only (`PipelineEngine.evaluate`), the same on every rank still training: the last stage's sums
        are summed over the stage's ranks, then along the chain. The caller keeps the RNG state."""
        self.stage.eval()
        total, count = 0.0, 0
        try:
            for batch in batches:
                ids, labels, n, rows, real_B = self._rows(batch)
                total += self.engine.evaluate(ids, labels, rows, real_B)
                count += n
        finally:
            self.stage.train()
        v = torch.tensor([total], dtype=torch.float64)  # host numbers: gloo, like the step's bookkeeping
        if self.data_ranks > 1:
            dist.all_reduce(v, group=self.stage_group)
        return float(self.chain.allreduce_sum(v)[0]), float(count)

    def agree_any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank still training (every one of them gets the same answer)."""
        v = torch.tensor([float(flag)], dtype=torch.float64)
        if self.data_ranks > 1:
            dist.all_reduce(v, group=self.stage_group)
        return float(self.chain.allreduce_sum(v)[0]) > 0

    def _set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr

    # ---- gradients ----
    def _slot_params(self) -> dict[int, list[torch.nn.Parameter]]:
        """The parameters of each cost slot held here, in model order, each once: a tied weight in the
        embedding's slot only, where a one-stage pipeline holds it as the embedding and the head (its slots are
        U and U + 1), and a tied head's copy not at all (its gradient is the embedding's, summed and counted
        there: `tied.py`). Summing or squaring a parameter in two slots would count its gradient twice."""
        seen = set() if self.tied is None or self.tied.copy is None else {id(self.tied.copy)}
        out: dict[int, list[torch.nn.Parameter]] = {}
        for slot, m in sorted(self.stage.slot_modules().items()):
            out[slot] = [p for p in m.parameters() if id(p) not in seen]
            seen.update(id(p) for p in out[slot])
        return out

    def _sync_grads(self) -> None:
        """Sum gradients over the ranks that hold the same parameters, one bucket per layer and kind (a layer's
        buckets have the same layout wherever it sits, so the sums are the same with or without migrations):
        replicated parameters over every rank of the stage ("dp_ep"), expert shards over their data-parallel
        copies ("dp"; the expert-parallel all-to-all's backward already summed the shard's tokens). Sharded
        state: reduce-scattered into the owned parts instead, over the same ranks (`ShardedAdamW.reduce`; under
        `parallel.shard: full` FSDP2 has reduced the dense ones and the expert ones go out here). Tied embeddings
        across stages: the head's gradient joins the embedding's first (`TiedEmbedding.sum_grads`)."""
        if self.tied is not None:
            self.tied.sum_grads(self.sharded)
        if self.sharded is not None:
            self.sharded.reduce()
            return
        if self._fsdp_mesh is not None:
            # FSDP2 summed the dense gradients into the shards in each micro-batch's backward; expert-parallel
            # experts' are reduce-scattered now, after Agg
            if isinstance(self.optimizer, StageShardedAdamW):
                self.optimizer.reduce()
            return
        slots = self._slot_params()
        if self.scheme.idle_parameters():
            self._join_peers_grads(slots)
        for _, params in slots.items():
            for expert, group, n in ((False, self.stage_group, self.data_ranks), (True, self.dp_group, self.dp)):
                grads = [p.grad for p in params if p.grad is not None and is_expert_param(p) == expert]
                if n == 1 or not grads:
                    continue
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=group)
                for g, chunk in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                    g.copy_(chunk.view_as(g))

    def _join_peers_grads(self, slots: dict[int, list[torch.nn.Parameter]]) -> None:
        """Zero gradients for the parameters this rank has none of while a peer of its group has one: a layer no
        token of this rank's rows reached (early exit) or an idle router (MoD). Each bucket's all-reduce then has
        the same members and size on every rank (unmatched, they paired one layer's bucket with another's, or
        failed on the size), and the sum is the peers' (zeros add nothing). A parameter no rank of the group has
        a gradient of keeps None, which AdamW skips, as one process does. One small host all-reduce per kind."""
        for expert, group, n in ((False, self.stage_group, self.data_ranks), (True, self.dp_group, self.dp)):
            params = [p for ps in slots.values() for p in ps if p.requires_grad and is_expert_param(p) == expert]
            if n == 1 or not params:
                continue
            has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
            dist.all_reduce(has, group=group)  # a CPU tensor: gloo under the device-aware backend
            for p, k in zip(params, has.tolist()):
                if k and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _reduce(self, res: IterationResult, t_run: float) -> dict[str, Any]:
        """One vector summed along the chain: gradient squares per cost slot (units, embedding, head), MoE
        auxiliary losses per layer, the loss, per-stage times, scheme statistics, expert metrics, each MoE
        layer's routing statistics (summed over its stage already: `StageExperts.routing_vector`).

        Host bookkeeping (times and losses are host floats already): a CPU vector, so its collectives and the
        chain's messages go to gloo under the device-aware backend. Only the gradient squares are computed on
        the device, and read back once (`_grad_squares`)."""
        L, S, P0 = self.L, self.U + 2, self.P0
        n = S + L + 1 + 4 * P0
        extra = self.scheme.stats_size(L)
        n_ep = self.experts.vector_size(L)
        routing = self.experts.routing_vector(L)  # stage sums already: the chain adds each layer's stage
        vec = torch.zeros(n + extra + n_ep + routing.numel(), dtype=torch.float64)
        if extra:
            vec[n:n + extra] = self.scheme.local_stats()
        if n_ep:
            vec[n + extra:n + extra + n_ep] = self.experts.step_vector(L)
        vec[n + extra + n_ep:] = routing
        # one host read: the gradient squares with the engine's loss and auxiliary-loss sums
        vec[:S] = torch.tensor(res.settle(self._grad_squares(S)), dtype=torch.float64)
        for i, a in res.aux_by_layer.items():
            vec[S + i] = a
        t = S + L + 1  # the per-stage times
        vec[S + L] = res.loss_sum
        pos = self._orig_pos()
        vec[t + pos] = res.busy_s
        vec[t + P0 + pos] = t_run
        vec[t + 2 * P0 + pos] = res.busy_cpu_s
        vec[t + 3 * P0 + pos] = res.w_cpu_s
        if self.data_ranks > 1:  # the loss of each rank's rows adds up; norms are equal after the gradient sum,
            # and scheme statistics are taken over the whole stage; under `moe.aux_loss_scope: sequence` the
            # auxiliary losses are each rank's rows' own: their mean (the other scopes' are the same on every rank)
            rows_own = self.cfg.moe.aux_loss_scope == "sequence"
            lo = S if rows_own else S + L
            part = vec[lo:S + L + 1].clone()
            dist.all_reduce(part, group=self.stage_group)
            vec[S + L] = part[-1]
            if rows_own:
                vec[S:S + L] = part[:L] / self.data_ranks
            if extra:
                stats = vec[n:n + extra].clone()
                dist.all_reduce(stats, group=self.stage_group)
                vec[n:n + extra] = stats
        out = self.chain.allreduce_sum(vec)
        if extra:
            self.scheme.set_global_stats(out[n:n + extra])
        if n_ep and self.scheme.uses_placement and self.cfg.planner.policy != "static":
            # each MoE layer's busiest rank over the mean under the placement the step ran (a chain's: one
            # replica's), the largest over the data-parallel replicas
            placed = placed_imbalance(out[n + extra:n + extra + n_ep], L).clone()
            if self.dp > 1:
                dist.all_reduce(placed, op=dist.ReduceOp.MAX, group=self.dp_group)
            self.scheme.observe_placement(placed.tolist())
        red = {"sq": out[:S], "aux": out[S:S + L], "loss": float(out[S + L]),
               "busy": out[t:t + P0].tolist(), "run": out[t + P0:t + 2 * P0].tolist(),
               "busy_cpu": out[t + 2 * P0:t + 3 * P0].tolist(), "w_cpu": out[t + 3 * P0:n].tolist()}
        moe_ids = [i for i in range(L) if self.cfg.is_moe_layer(i)]
        if n_ep:
            red["experts"] = {**stage_metrics(out[n + extra:n + extra + n_ep], L, moe_ids),
                              **self.experts.feedback_record()}
        red["routing"] = stage_routing(out[n + extra + n_ep:], L, moe_ids, self.cfg.moe.num_experts)
        return red

    def _grad_squares(self, S: int) -> torch.Tensor:
        """[S] float64 on the compute device: squared gradient norms per cost slot, each slot summed parameter
        by parameter in model order (the same bits wherever the slot sits); expert shards' squares summed over
        the ep group there (NCCL on CUDA). Sharded state: the owned parts' squares per slot, summed over the
        stage (the same norms up to summation order)."""
        if self.sharded is not None:
            slot_of = {id(p): slot for slot, params in self._slot_params().items() for p in params}
            return self.sharded.squares_by(lambda p: slot_of[id(p)], S)
        if self._fsdp_mesh is not None:
            return self._shard_squares(S)
        rep_S = torch.zeros(S, dtype=torch.float64, device=self.device)
        shard_S = torch.zeros(S, dtype=torch.float64, device=self.device)
        for slot, params in self._slot_params().items():
            sq = torch.zeros((), dtype=torch.float64, device=self.device)
            for p in params:
                if p.grad is not None and not is_expert_param(p):
                    sq += torch.linalg.vector_norm(p.grad.double()) ** 2
                elif p.grad is not None:
                    shard_S[slot] += torch.linalg.vector_norm(p.grad.double()) ** 2
            rep_S[slot] = sq
        if self.experts.sharded:  # each rank holds other experts: their squares add up over the ep group
            rep_S += self.experts.shard_sum(shard_S)
        return rep_S

    def _shard_squares(self, S: int) -> torch.Tensor:
        """`_grad_squares` under `parallel.shard: full`: the squares of this rank's gradient shards per slot,
        summed over the stage (the shards partition each gradient; the same norms up to summation order)."""
        out_S = torch.zeros(S, dtype=torch.float64, device=self.device)
        for slot, params in self._slot_params().items():
            for p in params:
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    out_S[slot] += torch.linalg.vector_norm(g.double()) ** 2
        if self.data_ranks > 1:
            dist.all_reduce(out_S, group=self.stage_group)
        experts = self.optimizer.experts if isinstance(self.optimizer, StageShardedAdamW) else None
        if experts is not None:  # expert-parallel experts' owned parts (their full-size gradients are gone)
            slot_of = {id(p): slot for slot, params in self._slot_params().items() for p in params}
            out_S += experts.squares_by(lambda p: slot_of[id(p)], S)
        return out_S

    def _orig_pos(self) -> int:
        return self.dims.ranks_of("pp").index(self.dims.rank)

    def _clip(self, sq: torch.Tensor) -> float:
        """torch's clip_grad_norm_ rule, with the global norm summed slot by slot in model order."""
        total = 0.0
        for v in sq.tolist():
            total += v
        norm = math.sqrt(total)
        clip = self.cfg.train.grad_clip
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0 and self.sharded is not None:
                self.sharded.scale_grads(torch.tensor(coef, dtype=torch.float64))
            elif coef < 1.0:
                for p in self.stage.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
                if isinstance(self.optimizer, StageShardedAdamW) and self.optimizer.experts is not None:
                    self.optimizer.experts.scale_grads(torch.tensor(coef, dtype=torch.float64))
        return norm

    def _record(self, step: int, lr: float, count: int, red: dict[str, Any], grad_norm: float, dt: float,
                overhead: float, profiled: bool, changed: bool, events: dict[str, Any]) -> dict[str, Any]:
        busy = [b for b, r in zip(red["busy"], red["run"]) if r > 0]
        busy_cpu = [b for b, r in zip(red["busy_cpu"], red["run"]) if r > 0]
        w_cpu = [b for b, r in zip(red["w_cpu"], red["run"]) if r > 0]
        run = max(red["run"]) if red["run"] else 0.0
        aux = 0.0
        for a in red["aux"].tolist():
            aux += a
        rec: dict[str, Any] = {
            "step": step, "loss": red["loss"], "aux_loss": aux, "grad_norm": grad_norm, "lr": lr,
            "step_time_s": round(dt, 6), "tokens": count, "tokens_per_s": round(count / max(dt, 1e-9), 2),
            "stages": len(busy), "sizes": list(self.sizes), "stage_busy_s": [round(b, 6) for b in busy],
            "stage_cpu_s": [round(b, 6) for b in busy_cpu], "stage_w_cpu_s": [round(b, 6) for b in w_cpu],
            "pipeline_s": round(run, 6), "bubble_ratio": round(1 - sum(busy) / max(len(busy) * run, 1e-12), 4),
            "busy_imbalance": round(imbalance(busy), 4) if busy else 1.0,
            "cpu_imbalance": round(imbalance(busy_cpu), 4) if busy_cpu and sum(busy_cpu) > 0 else 1.0,
            "overhead_s": round(overhead, 6),
            "profiled": profiled, "dynamism_event": changed, **self.scheme.metrics(), **red.get("experts", {}),
            **red["routing"]}
        if self.units.split_layers:  # sizes count units; a layer's half counts 0.5 here
            rec["stage_layers"] = self.units.stage_layers(self.sizes)
        rec.update(self.balancer.record_fields())
        rec.update({k: v for k, v in events.items() if k != "adopted"})
        return rec

    # ---- checkpoints (the trainer writes them, moebal/train/pipelined.py; weights and optimizer by logical name) ----
    def data_state(self) -> dict[str, Any]:
        """The data position of the next step to train."""
        return self.data.train.state_dict()

    def resume_partition(self, sizes: list[int]) -> None:
        """Migrate to the partition a checkpoint was taken under (after its weights and optimizer state were
        loaded into this run's initial partition): the resumed run then plans as the uninterrupted one."""
        self.balancer.apply(list(sizes), "resume", self.step)

    def state_dict(self) -> dict[str, Any]:
        """This rank's runner state as JSON: the partition, the smoothed costs and link figures (identical on
        every rank), the scheme's job-wide state, and the expert planners of the layers held here. (The
        scheme's per-layer tensors go into the checkpoint's extra tensors: `scheme_tensors`.)"""
        return {"sizes": list(self.sizes), "chain": self.P0, "coords": dict(self.dims.coords),
                "layers": list(self.stage.layer_ids), "units": self.units.split_layers,
                **self.balancer.state_dict(),
                "scheme_name": self.scheme.name, "scheme": self.scheme.state_dict(),
                "experts": self.experts.state_dict()}

    @staticmethod
    def job_state(ranks: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The saved state that is the job's (rank 0's, else any saved rank's): costs, scheme, plan scales."""
        return ranks.get("0") or next(iter(ranks.values()), {})

    def load_state_dict(self, ranks: dict[str, dict[str, Any]], same_stages: bool = False) -> list[int] | None:
        """Restore from every saved rank's `state_dict` (any layout: what does not carry over is rebuilt) and
        return the saved partition when it fits this chain (the caller migrates to it once the weights are
        loaded), else None: it fits when the saved chain had as many ranks as this one, or when
        `same_stages` (the ranks of a stage are the same, data- and expert-parallel) and the saved partition
        (re-packed onto fewer stages, say) has as many stages as this chain. The per-layer costs, link
        figures and scheme state are the job's (rank 0's); each held MoE layer's planner comes from the saved
        rank that held the layer in the same expert-parallel position (and data-parallel replica, when there
        is one). A checkpoint of another dynamism scheme leaves this scheme's state as it starts."""
        self._scheme_resumed = False
        if not ranks:
            return None
        first = self.job_state(ranks)
        if "tracker" not in first:
            return None  # written by the single-stage trainer: nothing of a pipeline to restore
        self.balancer.load_state_dict(first)
        if first.get("scheme_name", self.scheme.name) == self.scheme.name:
            self.scheme.load_state_dict(first["scheme"])
            self._scheme_resumed = True
        me = self.dims.coords

        def held_by(s: dict[str, Any]) -> int:  # same ep position first, then the same replica
            c: dict[str, int] = s["coords"]
            return (c["ep"] != me["ep"]) * 2 + (c["dp"] != me["dp"])

        layers: dict[int, dict[str, Any]] = {}
        for s in sorted(ranks.values(), key=held_by, reverse=True):  # the best match is written last
            if s["experts"].get("R") == self.dims.ep and s["coords"]["ep"] == me["ep"]:
                layers.update({int(i): p for i, p in s["experts"]["planners"].items()})
        self.experts.load_state_dict(first["experts"], layers)
        fits = first["chain"] == self.P0 or (same_stages and len(first["sizes"]) == self.P0)
        fits = fits and first.get("units", []) == self.units.split_layers  # sizes count the same units
        return list(first["sizes"]) if fits else None

    # ---- the scheme's per-layer state in checkpoints (keyed by global layer, so any partition resumes it) ----
    def scheme_tensors(self, dense: bool = True, experts: bool = True) -> dict[str, torch.Tensor]:
        """The scheme's `layer_state` of every layer held here, by checkpoint name: `dynamism.layers.<i>.<key>`;
        a parameter-shaped entry (`<kind>:<parameter>`) of an expert-stacked parameter is split into one
        tensor per logical expert (`<kind>:...experts.<e>.w1`), like the weights. `dense`/`experts`: which
        of the two kinds this rank writes (the checkpoint's writer assignment)."""
        from moebal.train.checkpoint import stacked_experts

        out: dict[str, torch.Tensor] = {}
        for i in self.stage.layer_ids:
            stacked = stacked_experts(self.stage.layer(i))
            for key, t in self.scheme.layer_state(i).items():
                for name, row in _scheme_names(i, key, tuple(t.shape), stacked):
                    if (experts if row is not None else dense):
                        out[name] = t if row is None else t[row]
        return out

    def read_scheme_tensors(self, reader: Any) -> dict[int, dict[str, torch.Tensor]]:
        """Read (and check) the scheme state of every layer held here from checkpoint `reader`; nothing is
        applied (`load_scheme_tensors` does that once every rank has read its part)."""
        from moebal.errors import CheckpointError
        from moebal.train.checkpoint import stacked_experts, with_previous_hint

        if not self._scheme_resumed:
            return {}
        saved = set(reader.extra_names())
        out: dict[int, dict[str, torch.Tensor]] = {}
        for i in self.stage.layer_ids:
            layer = self.stage.layer(i)
            stacked = stacked_experts(layer)
            state = {}
            for key, (shape, dtype) in self.scheme.layer_state_spec(i, layer).items():
                names = _scheme_names(i, key, shape, stacked)
                missing = [n for n, _ in names if n not in saved]
                if missing:
                    raise CheckpointError(f"{reader.path} holds no '{missing[0]}' (the {self.scheme.name} scheme's "
                                          f"state of layer {i}): it was written by a moebal that did not save "
                                          f"it; resume it with dynamism.scheme none, or start the run afresh")
                try:
                    parts = [reader.read_extra(n) for n, _ in names]
                except CheckpointError as e:  # a damaged file: offer the previous good checkpoint
                    raise with_previous_hint(reader.path, e) from None
                t = parts[0] if names[0][1] is None else torch.stack(parts)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise CheckpointError(f"{reader.path}: the {self.scheme.name} state '{key}' of layer {i} has "
                                          f"shape {tuple(t.shape)} and dtype {t.dtype}, this model needs "
                                          f"{tuple(shape)} and {dtype}: resume with the model config the "
                                          f"checkpoint was written with")
                state[key] = t.to(self.device)
            out[i] = state
        return out

    def load_scheme_tensors(self, layers: dict[int, dict[str, torch.Tensor]]) -> None:
        """Install what `read_scheme_tensors` read (after the weights are loaded) and let the scheme re-apply
        its effect; a scheme that starts afresh (the checkpoint had another) starts from the loaded weights."""
        ctx = self._ctx()
        if not self._scheme_resumed:
            ctx.rows, ctx.device = self._micro_rows() * self.cfg.data.seq_len, self.device
            self.scheme.on_start(ctx)
            return
        for i, state in layers.items():
            self.scheme.load_layer_state(i, self.stage.layer(i), state)
        self.scheme.on_resume(ctx)
        self._follow_trainable()

    def full_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters by full-model name (tests compare them across partitions). Collective over the
        stage under `parallel.shard: full` (FSDP2's shards and expert weights at rest gathered)."""
        from moebal.distributed.sharded import weights_gathered

        with weights_gathered(self.optimizer):
            return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                    for k, v in self.stage.state_dict().items()}


class _SumsOfCopies:
    """The zero-bubble schedule's `GradReducer` under `parallel.shard: optimizer` with bf16 weights: W's deferred
    gradients of the compute copies go into the sharded optimizer's fp32 sums (`ShardedAdamW.holds`/`add`), as
    B's do through its gradient hook; whichever optimizer the runner holds now (migrations rebuild it)."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner

    def holds(self, p: torch.Tensor) -> bool:
        opt = self.runner.optimizer
        return isinstance(opt, ShardedAdamW) and opt.holds(p)

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        opt = self.runner.optimizer
        assert isinstance(opt, ShardedAdamW)
        opt.add(p, g)

    def flush(self) -> None:
        pass


def _scheme_names(i: int, key: str, shape: tuple[int, ...],
                  stacked: dict[str, tuple[tuple[int, ...], int]]) -> list[tuple[str, int | None]]:
    """Checkpoint names of layer i's scheme-state entry `key`: one, or for an entry shaped like an
    expert-stacked parameter (`<kind>:<parameter>`) one per row, named by logical expert (with the row)."""
    from moebal.train.checkpoint import expert_name

    kind, sep, param = key.partition(":")
    ids = stacked.get(param, ((), 0))[0] if sep else ()
    if ids and len(shape) > 0 and shape[0] == len(ids):
        return [(f"dynamism.layers.{i}.{kind}:{expert_name(param, e)}", row) for row, e in enumerate(ids)]
    return [(f"dynamism.layers.{i}.{key}", None)]


def _build_data(cfg: Config) -> DataBundle:
    from moebal.data import build_data

    return build_data(cfg)
