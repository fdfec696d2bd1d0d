"""The pipeline step: this rank's stage of a `--pp P` run (or the one stage of a dynamism scheme's run at
`--pp 1`: `Config.pipelined`), trained by the pipeline runner.

`PipelineStep` wraps `PipelineRunner` (fixed micro-batches) or `PlannedPipelineRunner` (planned
micro-batching) as the trainer's step strategy (moebal/train/strategy.py); the trainer does the rest, as for
every mode. The runner's metrics line per step: loss, step time, tokens/s, layers per stage, per-stage busy
time, bubble ratio, measured and predicted imbalance, migrations, bytes moved, released ranks, the scheme's
state, each MoE layer's routing summary (as the trainer without a pipeline records it); `plans.jsonl` gets
every stage plan, adopted or not; `pipeline.svg` is a Gantt chart of one iteration before the first adopted plan
and after the latest.

Checkpoints are the trainer's (`moebal/train/checkpoint.py`): every rank writes the logical tensors of the
layers it holds (the first rank of each stage's data x expert group the dense ones, the first of each
data-parallel group its expert shards), so a pipeline checkpoint resumes under any number of stages, or
none, and a single-stage checkpoint resumes as a pipeline. Per rank it also keeps the runner's state (the
partition, smoothed costs, link figures, expert planners, the dynamism scheme's job-wide state) and RNG; the
scheme's per-layer tensors (pruning masks and kernel choices, freezing snapshots) are extra tensors keyed by
global layer index (`PipelineRunner.scheme_tensors`), so they resume under any partition; so is plan-ahead's
online path profile, by MoE layer and token shard (`StageExperts.ahead_tensors`). Under the same
layout the resumed run migrates to the saved partition and continues exactly, under another it starts from
its initial partition. After a re-pack only the ranks still training write, and the layout records the
active stages and ranks: resumed on the launch layout the job re-packs again at once (the released ranks
leave), resumed on as many ranks as were still training it continues on the saved partition.

Validation runs the stages forward only (`PipelineRunner.evaluate`); a rank a re-pack released leaves the
trainer's loop after the step that released it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moebal.config import Config
from moebal.data import DataBundle
from moebal.dynamism.scheme import Dynamism, build_dynamism
from moebal.errors import CheckpointError
from moebal.pipeline.runner import PipelineRunner
from moebal.train.distributed import RunContext
from moebal.train.strategy import StepOutput

if TYPE_CHECKING:
    from moebal.distributed.groups import ParallelDims
    from moebal.distributed.plan_ahead import SavedWindow
    from moebal.train.checkpoint import CheckpointReader
    from moebal.train.hooks import Hook
    from moebal.train.trainer import Trainer

__all__ = ["PipelineStep", "build_runner", "pipeline_trainer", "scheme_from_config"]


def scheme_from_config(cfg: Config) -> Dynamism:
    """The run's dynamism scheme (`dynamism.scheme` with its settings)."""
    name = cfg.dynamism.scheme
    options = {} if name == "none" else dataclasses.asdict(getattr(cfg.dynamism, name))
    return build_dynamism(name, options, cfg=cfg)


def build_runner(cfg: Config, dims: ParallelDims, data: DataBundle, **knobs: Any) -> PipelineRunner:
    """This rank's pipeline runner for `cfg`: planned micro-batches unless `pipeline.microbatching` is fixed.
    `knobs`: the runner's experiment keywords (`force`, `force_mid`, `record_ops`, `bandwidth`, `latency`)."""
    runner_cls: type[PipelineRunner] = PipelineRunner
    if cfg.pipeline.microbatching != "fixed":
        from moebal.pipeline.planned import PlannedPipelineRunner

        runner_cls = PlannedPipelineRunner
    return runner_cls(cfg, scheme=scheme_from_config(cfg), dims=dims, data=data, device=dims.device, **knobs)


def pipeline_trainer(cfg: Config, run_dir: str | Path, *, resume: bool | str | Path = False,
                     require_checkpoint: bool = True, hooks: list[Hook] | None = None, dims: ParallelDims | None = None,
                     **knobs: Any) -> Trainer:
    """The trainer of this rank's pipeline stage (torchrun environment). `dims`: the process groups of a job
    already set up (tests run several pipelines in one job), else the job's, joined here; `Trainer.close`
    releases the runner, the caller the process groups (`trainer.ctx.dims.close()`).

    With `scheduler.expert_packing: lina` the stages' expert-parallel size is chosen first (measured on the job,
    or read from `run_dir`'s packing.json when the run resumes; moebal/balance/packing.py) and becomes the run's
    `parallel.ep`."""
    from moebal.data import build_data
    from moebal.distributed.groups import ParallelDims, env_world, pick_device
    from moebal.pipeline.runner import pipeline_ep
    from moebal.train.trainer import Trainer, set_threads

    set_threads(cfg)
    if dims is None:
        rank, world, local = env_world()
        if cfg.scheduler.expert_packing != "off" and cfg.moe.num_experts:
            from moebal.balance.packing import choose_expert_parallel

            ep0 = min(pipeline_ep(cfg, world), cfg.moe.num_experts)
            ep = choose_expert_parallel(cfg, world, rank, pick_device(local), ep0, Path(run_dir), bool(resume))
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))
        dims = ParallelDims.from_env(ep=pipeline_ep(cfg, world), pp=cfg.parallel.pp).init(
            60.0 * cfg.parallel.timeout_min)
    data = build_data(cfg)
    runner = build_runner(cfg, dims, data, **knobs)
    try:
        return Trainer(cfg, run_dir, hooks=hooks, resume=resume, device=dims.device, data=data, ctx=RunContext(dims),
                       require_checkpoint=require_checkpoint, strategy=PipelineStep(runner))
    except BaseException:
        runner.close()
        raise


@dataclasses.dataclass
class _Totals:
    """What `PipelineStep.summary` reads of the run's step records, kept as running sums: the records themselves
    (each carries per-layer expert counts and loads) are not kept through a run."""

    lookahead: int
    """Planned micro-batching's first plans that also wait for the workers: left out of the exposed planning."""
    steps: int = 0
    migrations: int = 0
    layers_moved: int = 0
    bytes_moved: int = 0
    released: set[int] = dataclasses.field(default_factory=set)
    bubble_last: float | None = None
    planned: bool = False
    tokens: int = 0
    computed_tokens: int = 0
    micro_batches: int = 0
    schedules: dict[str, int] = dataclasses.field(default_factory=dict)
    wait_s: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    """Planning waits: [every step, steps after `lookahead`]."""
    step_s: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    """Step times: [every step, steps after `lookahead`]."""

    def add(self, rec: dict[str, Any]) -> None:
        if rec.get("migration"):
            self.migrations += 1
            self.layers_moved += rec["layers_moved"]
            self.bytes_moved += rec["bytes_moved"]
        self.released.update(rec.get("released_ranks", []))
        self.bubble_last = rec["bubble_ratio"]
        if self.steps == 0:
            self.planned = "padding_efficiency" in rec
        if self.planned:
            self.tokens += rec["tokens"]
            self.computed_tokens += rec["computed_tokens"]
            self.micro_batches += rec["micro_batches"]
            self.schedules[rec["schedule"]] = self.schedules.get(rec["schedule"], 0) + 1
            steady = self.steps >= self.lookahead
            for i in (0, 1) if steady else (0,):
                self.wait_s[i] += rec["plan_wait_s"]
                self.step_s[i] += rec["step_time_s"]
        self.steps += 1


class PipelineStep:
    """`StepStrategy` of this rank's pipeline stage (module docstring)."""

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner
        d = runner.dims
        self._layout = {"world_size": d.world_size, "pp": d.pp, "dp": d.dp, "ep": d.ep}
        self._totals = _Totals(runner.cfg.pipeline.dynamic.lookahead)
        self._scheme_layers: dict[int, dict[str, torch.Tensor]] = {}
        self._saved_sizes: list[int] | None = None
        self._ahead_windows: dict[int, SavedWindow] = {}  # plan-ahead's saved online profiles (`read_state`)

    @property
    def module(self) -> torch.nn.Module:
        return self.runner.stage

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.runner.optimizer

    @property
    def released(self) -> bool:
        return self.runner.released

    def describe(self) -> str:
        cfg, d = self.runner.cfg, self.runner.dims
        p = cfg.pipeline
        micro = (f"{p.schedule} with {p.micro_batches} micro-batches" if p.microbatching == "fixed" else
                 f"{p.microbatching} micro-batching ({p.dynamic.schedules})")
        return (f"{d.pp}-stage pipeline x {d.dp} data-parallel x {d.ep} expert-parallel, {micro}, rebalance "
                f"{p.rebalance}, dynamism {cfg.dynamism.scheme}")

    def start(self, trainer: Trainer) -> None:
        for batch in trainer.data.val:  # refused now, not at the first validation, hours into the run
            self.runner.check_rows(batch.ids_BT.shape[0])
        self.runner.start()  # link measurements when planning needs them (collective along the chain)

    def train_step(self, trainer: Trainer, step: int) -> StepOutput:
        assert step == self.runner.step + 1, "the trainer and the pipeline runner count steps alike"
        record = self.runner.train_step()
        # a trainer's run keeps sums of the records and of no plan (rank 0 writes them out as they come,
        # `new_plans`), so that neither grows with the run on any rank
        self._totals.add(record)
        self.runner.records.clear()
        if not trainer.ctx.is_main:
            self.runner.plans.clear()
        return StepOutput(record, int(record["tokens"]))

    def routing_sample(self, trainer: Trainer, step: int) -> torch.Tensor | None:
        # gathered along the chain inside the step, before a migration could move a layer away
        return self.runner.take_routing_sample() if trainer.ctx.is_main else None

    # ---- validation and agreement ----
    def evaluate(self, trainer: Trainer) -> tuple[float, float]:
        return self.runner.evaluate(trainer.data.val)

    def agree_any(self, flag: bool) -> bool:
        return self.runner.agree_any(flag)

    def barrier(self) -> None:
        self.runner.agree_any(False)  # a collective over every rank still training

    # ---- checkpoints ----
    def alive(self) -> list[int]:
        """Ranks still training: after a re-pack, the pipeline positions kept (the same in every replica)."""
        d, chain = self.runner.dims, self.runner.chain
        kept = {d.ranks_of("pp").index(r) for r in chain.ranks}
        return [r for r in range(d.world_size) if r // (d.ep * d.dp) in kept]

    def layout(self) -> dict[str, Any]:
        """The layout the job was launched with, and the one training now (after a re-pack: fewer stages, the
        ranks still in; the checkpoint's writers)."""
        alive = self.alive()
        return {**self._layout, "active": {"pp": self.runner.chain.size, "world_size": len(alive), "ranks": alive}}

    def writing_ranks(self) -> list[int]:
        return self.alive()

    def data_state(self) -> dict[str, Any]:
        return self.runner.data_state()

    def rank_state(self) -> dict[str, Any]:
        return {"pipeline": self.runner.state_dict()}

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        d = self.runner.dims
        return {**self.runner.scheme_tensors(d.index("dp_ep") == 0, d.index("dp") == 0),
                **self.runner.experts.ahead_tensors()}

    def saved_rank(self, state: dict[str, Any]) -> str:
        """The saved rank whose per-rank state (RNG) this rank continues: itself under the launch layout it
        was saved with; under the layout that was training when it was saved (a re-packed job resumed on its
        surviving ranks) the saved rank in the same place; else rank 0 (another layout)."""
        saved, me = state.get("layout") or {}, self.runner.dims.rank
        launched = {k: saved.get(k) for k in self._layout}
        if launched == self._layout:
            return str(me) if str(me) in state["ranks"] else "0"  # released since: no state of its own
        active = saved.get("active")
        if active and active["pp"] == self._layout["pp"] and active["world_size"] == self._layout["world_size"] \
                and saved.get("dp") == self._layout["dp"] and saved.get("ep") == self._layout["ep"]:
            return str(active["ranks"][me])
        return "0"

    def read_state(self, reader: CheckpointReader) -> None:
        """The runner's state of every saved rank, and the scheme's per-layer tensors of the layers held here,
        read and checked on every rank (one rank's error is every rank's) before anything is applied."""
        r, s = self.runner, reader.state
        saved = s.get("layout") or {}
        same_stages = saved.get("dp") == self._layout["dp"] and saved.get("ep") == self._layout["ep"]
        self._saved_sizes = r.load_state_dict({k: v["pipeline"] for k, v in s["ranks"].items() if "pipeline" in v},
                                              same_stages)
        error = None
        try:
            self._scheme_layers = r.read_scheme_tensors(reader)
            self._ahead_windows = r.experts.read_ahead(reader)
        except CheckpointError as e:
            error = str(e)
        errors = [e for e in RunContext(r.dims).gather(error) if e]  # every rank is still in the job here
        if errors:
            raise CheckpointError(errors[0])

    def apply_state(self, reader: CheckpointReader) -> None:
        """The step, the scheme's tensors, then the saved partition (a re-packed partition over this launch
        layout releases ranks again), then plan-ahead's online profile of the stage's layers."""
        r = self.runner
        r.step = reader.step
        r.load_scheme_tensors(self._scheme_layers)
        self._scheme_layers = {}
        if self._saved_sizes is not None and self._saved_sizes != r.sizes:
            r.resume_partition(self._saved_sizes)
        if not r.released:  # the stage's plan-ahead windows, over the partition now in place
            r.experts.resume_ahead(self._ahead_windows)
        self._ahead_windows = {}

    def settle_kernels(self, trainer: Trainer, recorded: dict[str, Any] | None) -> dict[str, Any] | None:
        return None  # stages run the configured expert kernel

    # ---- the end ----
    def new_plans(self) -> list[dict[str, Any]]:
        plans = list(self.runner.plans)
        self.runner.plans.clear()
        return plans

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """The pipeline's fields of `summary.json`: partition, migrations, released ranks, the last bubble
        ratio, and with planned micro-batching its padding efficiency, micro-batch counts and schedules."""
        r, t = self.runner, self._totals
        out: dict[str, Any] = {
            "final_sizes": r.sizes, "stages": len(r.sizes), "migrations": t.migrations,
            "layers_moved": t.layers_moved, "bytes_moved": t.bytes_moved, "released_ranks": sorted(t.released),
            "bubble_ratio_last": t.bubble_last}
        if t.steps and t.planned:
            steady = 1 if t.steps > t.lookahead else 0  # the first plans also wait for the workers
            out.update({
                "microbatching": trainer.cfg.pipeline.microbatching,
                "padding_efficiency": t.tokens / max(t.computed_tokens, 1),
                "micro_batches_mean": t.micro_batches / t.steps,
                "schedules": dict(sorted(t.schedules.items())),
                "planning_exposed_s": t.wait_s[steady],
                "planning_exposed_share": t.wait_s[steady] / max(t.step_s[steady], 1e-9)})
        return out

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        s = summary
        lines = [f"  pipeline: stages {s['final_sizes']}, {s['layers_moved']} layer moves "
                 f"({s['bytes_moved'] / 1e6:.1f} MB), released ranks {s['released_ranks'] or 'none'}"]
        if "padding_efficiency" in s:
            lines.append(f"  {s['microbatching']} micro-batching: padding efficiency {s['padding_efficiency']:.3f}, "
                         f"{s['micro_batches_mean']:.1f} micro-batches per step, schedules {s['schedules']}, "
                         f"planning exposed {100 * s['planning_exposed_share']:.1f} % of step time after warm-up")
        return lines

    def finish(self, trainer: Trainer) -> None:
        """The Gantt chart of one iteration before the first adopted plan and after the latest."""
        from moebal.pipeline.gantt import write_gantt

        gantt = self.runner.gantt
        if gantt:
            write_gantt(gantt.get("before", []), gantt.get("after", []), trainer.run_dir / "pipeline.svg",
                        title=trainer.cfg.dynamism.scheme)

    def close(self) -> None:
        self.runner.close()

