"""`moebal train --pp P`: one rank's pipeline run from a Config, writing the run directory on global rank 0.

Run directory (rank 0, which is never released: it holds the embedding): `config.yaml`, `metrics.jsonl`
(one line per step: loss, step time, tokens/s, layers per stage, per-stage busy time, bubble ratio, measured
and predicted imbalance, migrations, bytes moved, released ranks, the scheme's state), `plans.jsonl` (every
stage plan, adopted or not, with its predicted times, gain and migration cost), `dashboard.png` (the loss)
and `pipeline.png` (a Gantt chart of one iteration before the first adopted plan and after the latest),
`summary.json`. A released rank prints that it was released and returns 0; training goes on without it.

Checkpoints are the trainer's (`moebal/train/checkpoint.py`): every rank writes the logical tensors of the
layers it holds (the first rank of each stage's data x expert group the dense ones, the first of each
data-parallel group its expert shards), so a pipeline checkpoint resumes under any number of stages, or
none, and a trainer's checkpoint resumes as a pipeline. Per rank it also keeps the runner's state (the
partition, smoothed costs, link figures, expert planners, the dynamism scheme's job-wide state) and RNG; the
scheme's per-layer tensors (pruning masks and kernel choices, freezing snapshots) are extra tensors keyed by
global layer index (`PipelineRunner.scheme_tensors`), so they resume under any partition. Under the same
layout the resumed run migrates to the saved partition and continues exactly, under another it starts from
its initial partition. After a re-pack only the ranks still training write, and the layout records the
active stages and ranks: resumed on the launch layout the job re-packs again at once (the released ranks
leave), resumed on as many ranks as were still training it continues on the saved partition.

Not in pipeline mode (yet): validation passes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moebal.config import Config, dump
from moebal.dynamism.scheme import Dynamism, build_dynamism
from moebal.pipeline.runner import PipelineOptions, PipelineRunner, pipeline_ep

__all__ = ["options_from_config", "run_pipeline", "scheme_from_config"]


def options_from_config(cfg: Config) -> PipelineOptions:
    p = cfg.pipeline
    return PipelineOptions(schedule=p.schedule, micro_batches=p.micro_batches, rebalance=p.rebalance,
                           initial=p.initial, split_layers=p.split_layers, every=p.every, ema=p.ema,
                           min_gain=p.min_gain, confirm=p.confirm, repack=p.repack,
                           repack_slack=p.repack_slack,
                           min_stages=p.min_stages, memory_cap=p.memory_cap, wait=p.wait, dilate=p.dilate,
                           feedback=p.feedback)


def scheme_from_config(cfg: Config) -> Dynamism:
    name = cfg.dynamism.scheme
    options = {} if name == "none" else dataclasses.asdict(getattr(cfg.dynamism, name))
    return build_dynamism(name, options, cfg=cfg)


def run_pipeline(cfg: Config, out: Path, json_summary: bool = False, resume: bool | str = False,
                 require_checkpoint: bool = True, dims: Any = None) -> int:
    """Train `cfg` as a pipeline on this rank (torchrun environment); returns the process exit code. `dims`:
    the process groups of a job already set up (tests run several pipelines in one job; it stays open)."""
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims, env_world
    from moebal.train.trainer import default_threads

    wall0 = time.perf_counter()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.nproc or 1))  # ranks on this machine
    torch.set_num_threads(cfg.train.threads or default_threads(local))
    own = dims is None
    if dims is None:
        _, world, _ = env_world()
        dims = ParallelDims.from_env(ep=pipeline_ep(cfg, world), pp=cfg.parallel.pp).init(
            60.0 * cfg.parallel.timeout_min)
    main = dims.rank == 0
    runner: PipelineRunner | None = None
    try:
        runner_cls: type[PipelineRunner] = PipelineRunner
        if cfg.pipeline.microbatching != "fixed":
            from moebal.pipeline.planned import PlannedPipelineRunner

            runner_cls = PlannedPipelineRunner
        runner = runner_cls(cfg, options_from_config(cfg), scheme=scheme_from_config(cfg), dims=dims,
                            device=dims.device)
        if main:
            out.mkdir(parents=True, exist_ok=True)
            dump(cfg, out / "config.yaml")
            micro = (f"{cfg.pipeline.schedule} with {cfg.pipeline.micro_batches} micro-batches"
                     if cfg.pipeline.microbatching == "fixed" else
                     f"{cfg.pipeline.microbatching} micro-batching ({cfg.pipeline.dynamic.schedules})")
            sys.stderr.write(f"moebal train: {cfg.name}, {cfg.parallel.pp}-stage pipeline x {dims.dp} data-parallel "
                             f"x {dims.ep} expert-parallel, {micro}, rebalance {cfg.pipeline.rebalance}, "
                             f"dynamism {cfg.dynamism.scheme}, run directory {out}\n")
        ckpt = _Checkpoints(runner, cfg, out)
        if resume:
            ckpt.resume(resume, require_checkpoint)
        result = _loop(runner, cfg, out, main, ckpt)
        if runner.released:
            sys.stderr.write(f"moebal train: rank {dims.rank} released at step {runner.released_at} "
                             f"(re-packed onto fewer stages); exiting\n")
            return 0
        if main and runner.records:
            _finish(runner, result, cfg, out, time.perf_counter() - wall0, json_summary)
        elif main:
            print(f"moebal train: nothing to do, the run in {out} is at step {runner.step} of {cfg.train.steps}")
        return 0
    finally:
        if runner is not None:
            runner.close()
        if own and dist.is_initialized():
            dims.close()  # local for gloo: a released rank leaves without waiting for the others


def _loop(runner: PipelineRunner, cfg: Config, out: Path, main: bool, ckpt: _Checkpoints) -> dict[str, Any]:
    runner.start()
    metrics = (out / "metrics.jsonl").open("a", encoding="utf-8") if main else None  # a resume truncated it
    n_plans = 0
    t0 = time.perf_counter()
    try:
        while runner.step < cfg.train.steps and not runner.released:
            rec = runner.train_step()
            rec["time"] = round(time.time(), 3)  # wall clock, as the trainer logs it (recovery times, plots)
            ckpt.train_seconds += rec["step_time_s"]
            if metrics is not None:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                if len(runner.plans) > n_plans:
                    with (out / "plans.jsonl").open("a", encoding="utf-8") as f:
                        for plan in runner.plans[n_plans:]:
                            f.write(json.dumps(plan) + "\n")
                    n_plans = len(runner.plans)
                if rec["step"] % max(1, cfg.train.log_every * 10) == 0 or rec["step"] == cfg.train.steps:
                    sys.stderr.write(f"step {rec['step']:>5}  loss {rec['loss']:.4f}  {rec['tokens_per_s']:.0f} tok/s  "
                                     f"stages {rec['sizes']}  bubble {rec['bubble_ratio']:.2f}\n")
            every = cfg.train.ckpt_every
            if not runner.released and (runner.step == cfg.train.steps or (every > 0 and runner.step % every == 0)):
                ckpt.save()
    except BaseException:
        ckpt.checkpointer.wait_quietly()
        raise
    finally:
        if metrics is not None:
            metrics.close()
    ckpt.checkpointer.wait()
    return {"train_seconds": time.perf_counter() - t0}


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Checkpoints:
    """Checkpoints of a pipeline run: the trainer's format and writer, the pipeline's state (module docstring)."""

    def __init__(self, runner: PipelineRunner, cfg: Config, out: Path) -> None:
        import os

        from moebal.train.checkpoint import Checkpointer

        self.runner, self.cfg, self.out = runner, cfg, out
        d = runner.dims
        self.layout = {"world_size": d.world_size, "pp": d.pp, "dp": d.dp, "ep": d.ep}
        session = _gather(f"{int(time.time())}-{os.getpid()}")[0]  # every rank is still here at start-up
        self.write_dense, self.write_experts = d.index("dp_ep") == 0, d.index("dp") == 0
        self.checkpointer = Checkpointer(out, rank=d.rank, ranks=range(d.world_size),
                                         write_dense=self.write_dense, write_experts=self.write_experts,
                                         keep=cfg.train.keep_checkpoints, background=cfg.train.ckpt_async,
                                         session=session)
        self.tokens, self.train_seconds = 0, 0.0

    def alive(self) -> list[int]:
        """Ranks still training: after a re-pack, the pipeline positions kept (the same in every replica)."""
        d, chain = self.runner.dims, self.runner.chain
        kept = {d.ranks_of("pp").index(r) for r in chain.ranks}
        return [r for r in range(d.world_size) if r // (d.ep * d.dp) in kept]

    def active_layout(self) -> dict[str, Any]:
        """The layout the job was launched with, and the one training now (after a re-pack: fewer stages, the
        ranks still in; the checkpoint's writers)."""
        alive = self.alive()
        return {**self.layout, "active": {"pp": self.runner.chain.size, "world_size": len(alive), "ranks": alive}}

    def save(self) -> None:
        from moebal.config import dump
        from moebal.train.checkpoint import rng_state

        r = self.runner
        self.checkpointer.ranks = self.alive()  # a released rank writes nothing and is not waited for
        tokens = self.tokens + sum(rec["tokens"] for rec in r.records)
        self.checkpointer.save(r.step, r.stage, r.optimizer, config_yaml=dump(self.cfg),
                               layout=self.active_layout(),
                               global_state={"data": r.data_state(), "tokens": tokens,
                                             "train_seconds": self.train_seconds, "last_val": None},
                               rank_state={"rng": rng_state(), "pipeline": r.state_dict()},
                               extra=r.scheme_tensors(self.write_dense, self.write_experts))

    def saved_rank(self, state: dict[str, Any]) -> str | None:
        """The saved rank whose per-rank state (RNG) this rank continues: itself under the launch layout it
        was saved with; under the layout that was training when it was saved (a re-packed job resumed on its
        surviving ranks) the saved rank in the same place; else None (another layout: rank 0's)."""
        saved, me = state.get("layout") or {}, self.runner.dims.rank
        launched = {k: saved.get(k) for k in self.layout}
        if launched == self.layout:
            return str(me) if str(me) in state["ranks"] else None  # released since: no state of its own
        active = saved.get("active")
        if active and active["pp"] == self.layout["pp"] and active["world_size"] == self.layout["world_size"] \
                and saved.get("dp") == self.layout["dp"] and saved.get("ep") == self.layout["ep"]:
            return str(active["ranks"][me])
        return None

    def resume(self, resume: bool | str, require: bool = True) -> None:
        """Load a checkpoint of any layout (see the module docstring); every rank, before training. Without a
        checkpoint and not `require` (--auto-resume before the first checkpoint), start over."""
        from moebal.errors import CheckpointError
        from moebal.train.checkpoint import load_agreed, open_for_resume, restore_rng
        from moebal.train.metrics import MetricsLog

        r = self.runner
        reader = open_for_resume(self.out, resume, _gather, require)
        if reader is None:
            if r.dims.rank == 0:
                for name in ("metrics.jsonl", "plans.jsonl"):
                    MetricsLog.truncate_after(self.out / name, 0)
            return
        pending = load_agreed(reader, r.stage, r.optimizer, _gather)
        s = reader.state
        saved = s.get("layout") or {}
        same_stages = saved.get("dp") == self.layout["dp"] and saved.get("ep") == self.layout["ep"]
        sizes = r.load_state_dict({k: v["pipeline"] for k, v in s["ranks"].items() if "pipeline" in v}, same_stages)
        scheme_layers, error = {}, None
        try:  # the scheme's per-layer state, read and checked on every rank before anything is applied
            scheme_layers = r.read_scheme_tensors(reader)
        except CheckpointError as e:
            error = str(e)
        errors = [e for e in _gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        r.data.train.load_state_dict(s["data"])
        pending.apply()
        r.step, self.tokens, self.train_seconds = reader.step, int(s["tokens"]), float(s["train_seconds"])
        r.load_scheme_tensors(scheme_layers)
        if sizes is not None and sizes != r.sizes:
            r.resume_partition(sizes)  # a re-packed partition over this launch layout releases ranks again
        restore_rng(s["ranks"][self.saved_rank(s) or "0"]["rng"])
        if r.dims.rank == 0:
            for name in ("metrics.jsonl", "plans.jsonl"):
                MetricsLog.truncate_after(self.out / name, reader.step)


def _finish(runner: PipelineRunner, result: dict[str, Any], cfg: Config, out: Path, wall: float,
            json_summary: bool) -> None:
    from moebal.pipeline.gantt import write_gantt
    from moebal.train.dashboard import write_dashboard

    recs = runner.records
    tail = recs[-max(1, len(recs) // 10):]
    tokens = sum(r["tokens"] for r in recs)
    moves = [r for r in recs if r.get("migration")]
    summary = {
        "steps": runner.step, "train_loss": sum(r["loss"] for r in tail) / len(tail), "tokens": tokens,
        "tokens_per_s": tokens / max(sum(r["step_time_s"] for r in recs), 1e-9), "wall_seconds": wall,
        "train_seconds": result["train_seconds"], "final_sizes": runner.sizes, "stages": len(runner.sizes),
        "migrations": len(moves), "layers_moved": sum(r["layers_moved"] for r in moves),
        "bytes_moved": sum(r["bytes_moved"] for r in moves),
        "released_ranks": sorted({x for r in recs for x in r.get("released_ranks", [])}),
        "bubble_ratio_last": tail[-1]["bubble_ratio"], "run_dir": str(out)}
    if "padding_efficiency" in recs[0]:
        steady = recs[cfg.pipeline.dynamic.lookahead:] or recs  # the first plans also wait for the workers
        summary.update({
            "microbatching": cfg.pipeline.microbatching,
            "padding_efficiency": sum(r["tokens"] for r in recs) / max(sum(r["computed_tokens"] for r in recs), 1),
            "micro_batches_mean": sum(r["micro_batches"] for r in recs) / len(recs),
            "schedules": {k: sum(r["schedule"] == k for r in recs) for k in sorted({r["schedule"] for r in recs})},
            "planning_exposed_s": sum(r["plan_wait_s"] for r in steady),
            "planning_exposed_share": sum(r["plan_wait_s"] for r in steady) / max(sum(r["step_time_s"] for r in
                                                                                       steady), 1e-9)})
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    write_dashboard(recs, out / "dashboard.png", title=f"{cfg.name}: pipeline of {cfg.parallel.pp} stages")
    if runner.gantt:
        write_gantt(runner.gantt.get("before", []), runner.gantt.get("after", []), out / "pipeline.png",
                    title=cfg.dynamism.scheme)
    if json_summary:
        print(json.dumps(summary))
    else:
        print(f"moebal train: {summary['steps']} steps, loss {summary['train_loss']:.4f}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, stages {summary['final_sizes']}, "
              f"{summary['layers_moved']} layer moves ({summary['bytes_moved'] / 1e6:.1f} MB), released ranks "
              f"{summary['released_ranks'] or 'none'}\n  run directory: {out}")
        if "padding_efficiency" in summary:
            print(f"  {summary['microbatching']} micro-batching: padding efficiency "
                  f"{summary['padding_efficiency']:.3f}, "
                  f"{summary['micro_batches_mean']:.1f} micro-batches per step, schedules {summary['schedules']}, "
                  f"planning exposed {100 * summary['planning_exposed_share']:.1f} % of step time after warm-up")
