"""`moebal train [CONFIG] [--steps N] [--out DIR] [--seed S] [--resume] [key=value ...]`.

No CONFIG: the embedded default run (the config defaults; `configs/default.yaml` is their dump). With
`--resume` and no CONFIG, the run's own `config.yaml` is the base, so `moebal train --out DIR --resume`
continues exactly the run in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moebal.config import Config, TrainConfig, absolute_inputs, refuse_cpu_only, refuse_flag_and_override
from moebal.distributed.groups import check_env_world, pick_device
from moebal.errors import ConfigError
from moebal.fileio import write_text_whole
from moebal.interop.hf_config import load
from moebal.train.precision import resolve_precision

if TYPE_CHECKING:
    from moebal.distributed.groups import ParallelDims
    from moebal.train import Trainer

__all__ = ["add_arguments", "build_trainer", "run", "summary_lines"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", metavar="CONFIG",
                   help="YAML config or preset name (default: the embedded default run)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.lr=1e-3")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: train.out_dir/NAME-TIMESTAMP)")
    p.add_argument("--seed", type=int, help="seed of the run (train.seed)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out DIR from its latest checkpoint")
    p.add_argument("--resume-from", metavar="CKPT", help="continue from this checkpoint directory instead")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue the run in --out DIR from its newest complete checkpoint, or start it "
                        "when there is none (what restarted ranks run; moebal launch passes it)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--nproc", type=int, help="ranks to start on this machine (parallel.nproc); under torchrun the "
                   "world size comes from the environment")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --nproc: when a rank fails, restart every rank from the last checkpoint, up to N "
                        "times (under torchrun, its own --max-restarts does this)")
    p.add_argument("--ep", type=int, help="expert-parallel size (parallel.ep; default: every rank)")
    p.add_argument("--policy", choices=["static", "prophet", "fastermoe", "broadcast_topk"],
                   help="expert placement policy (planner.policy); fastermoe = FasterMoE's shadowing policy on "
                        "moebal's executor, not FasterMoE's system")
    p.add_argument("--pp", type=int, help="pipeline stages (parallel.pp)")
    p.add_argument("--rebalance", choices=["off", "partition", "diffusion"],
                   help="pipeline layer rebalancing (pipeline.rebalance)")
    p.add_argument("--microbatching", choices=["fixed", "dynamic", "padding", "packing"],
                   help="pipeline micro-batching (pipeline.microbatching): dynamic = DynaPipe")
    p.add_argument("--dynamism", choices=["none", "pruning", "freezing", "early_exit", "mod", "moe",
                                             "sparse_attention"],
                   help="dynamic-model scheme (dynamism.scheme)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even when the memory plan (`moebal plan memory`) predicts a rank will not fit")


def _split_positionals(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse cannot tell `CONFIG` from a first `key=value`; an item with '=' is always an override."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    return config, overrides


def _refuse_conflicts(args: argparse.Namespace, overrides: list[str]) -> None:
    """Two spellings of one setting with different values would leave one silently ignored."""
    if args.resume and args.resume_from:
        raise ConfigError("--resume (the newest checkpoint of --out) and --resume-from CKPT (a chosen one) "
                          "conflict: give one of them")
    refuse_flag_and_override(args, overrides, (
        ("steps", "train.steps"), ("seed", "train.seed"), ("nproc", "parallel.nproc"), ("ep", "parallel.ep"),
        ("pp", "parallel.pp"), ("policy", "planner.policy"), ("rebalance", "pipeline.rebalance"),
        ("dynamism", "dynamism.scheme"), ("microbatching", "pipeline.microbatching")))


def resolve_config(args: argparse.Namespace) -> tuple[Config, Path]:
    config, overrides = _split_positionals(args)
    _refuse_conflicts(args, overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    for flag, key in (("nproc", "parallel.nproc"), ("ep", "parallel.ep"), ("policy", "planner.policy"),
                      ("pp", "parallel.pp"), ("rebalance", "pipeline.rebalance"), ("dynamism", "dynamism.scheme"),
                      ("microbatching", "pipeline.microbatching")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}='{getattr(args, flag)}'")  # quoted: YAML would read a bare off as false
    resuming = args.resume or args.resume_from
    if resuming and not args.out and not args.resume_from:
        raise ConfigError("--resume needs --out DIR, the run directory to continue")
    if getattr(args, "auto_resume", False) and not args.out:
        raise ConfigError("--auto-resume needs --out DIR, the run directory to continue or start")
    out = Path(args.resume_from).parent if args.resume_from and not args.out else (Path(args.out) if args.out
                                                                                   else None)
    def written(f: Path) -> bool:  # (an empty file is a write a crash cut short: not the run's config)
        return f.is_file() and f.stat().st_size > 0

    if config is None and resuming and out is not None and written(out / "config.yaml"):
        config = str(out / "config.yaml")
    elif config is None and args.resume_from and written(Path(args.resume_from) / "config.yaml"):
        # a checkpoint continued into another run directory (a branch): the config it was written with
        config = str(Path(args.resume_from) / "config.yaml")
    elif config is None and args.resume and out is not None:
        from moebal.train.checkpoint import find_checkpoints

        newest = find_checkpoints(out)[-1:]  # the run's config.yaml lost: the one its newest checkpoint keeps
        if newest and written(newest[0] / "config.yaml"):
            config = str(newest[0] / "config.yaml")
    # input paths made absolute before config.yaml keeps them: a resume finds them from any working directory
    cfg = absolute_inputs(load(config, overrides))
    # auto precision is settled here, once, and config.yaml keeps the result (moebal/train/precision.py)
    cfg = resolve_precision(cfg, pick_device())
    if out is None:
        out = Path(cfg.train.out_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, out


def summary_lines(r: object, extra: list[str] | None = None) -> list[str]:
    """The printed summary of a run: the trainer's figures, then the strategy's own lines (`extra`)."""
    from moebal.train import RunResult
    from moebal.train.progress import format_duration

    assert isinstance(r, RunResult)
    val = "n/a (no validation split)" if r.val_loss is None else f"{r.val_loss:.4f}"
    ratio = "" if r.val_ratio is None else f" = {r.val_ratio:.3f} x"
    lines = [
        f"moebal train: {r.steps} steps in {format_duration(r.wall_seconds)} wall "
        f"(set-up {r.setup_seconds:.1f} s, training {r.train_seconds:.1f} s), "
        f"{r.tokens / 1e6:.2f}M tokens at {r.tokens_per_s / 1e3:.1f}k tokens/s",
        f"  loss (nats/token): train {r.train_loss:.4f} (mean of the last steps), validation {val}",
        f"  corpus unigram entropy {r.unigram_entropy:.4f}: validation{ratio} entropy, "
        f"train = {r.train_loss / r.unigram_entropy:.3f} x entropy",
    ]
    if r.load_imbalance:
        per = ", ".join(f"{x:.2f}" for x in r.load_imbalance)
        lines.append(f"  expert load max/mean per MoE layer (last 10% of steps): {per}; "
                     f"dropped assignments {r.dropped}")
    lines += extra or []
    if r.rollbacks:
        lines.append(f"  rollbacks after bad steps: {r.rollbacks} (rollbacks.jsonl)")
    if r.stopped_early:
        lines.append(f"  stopped early: {r.stopped_early}; `--resume` finishes the run")
    lines.append(f"  run directory: {r.run_dir}")
    return lines


def _local_ranks(cfg: Config) -> int:
    """Ranks to start here without torchrun: parallel.nproc, or one per visible GPU (2 on a CPU)."""
    import torch

    from moebal.launch.spawn import local_ranks

    return local_ranks(cfg.parallel.nproc, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _spawn(args: argparse.Namespace, cfg: Config, out: Path, nproc: int) -> int:
    """`--nproc N` without torchrun: start N ranks of this same command (they see RANK in their environment),
    all writing to one run directory."""
    # Bad input fails here, once, before any rank starts (the same checks every rank would make).
    from moebal.data import build_data
    from moebal.launch.spawn import spawn_local, start_rank_server

    start_rank_server(nproc)  # its imports (torch, moebal) run while the data is checked
    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import pipeline_ep, refuse_layout
    from moebal.train.distributed import RunContext

    # the split of the ranks into ep x pp, as every rank will make it (expert packing measures its ep on the
    # ranks: then only the stages are checked here; a dense model's ep is refused below, or is 1 without a pipeline)
    if cfg.scheduler.expert_packing != "off" or not cfg.moe.num_experts:
        ep = 1
    elif cfg.pipelined:
        ep = pipeline_ep(cfg, nproc)
    else:
        ep = cfg.parallel.ep or nproc
    RunContext(ParallelDims(world_size=nproc, rank=0, ep=ep, pp=cfg.parallel.pp)).check_batch(
        cfg.data.batch_size, cfg.train.grad_accum)
    if cfg.pipelined:  # what each stage's runner would refuse, said once
        from moebal.train.pipelined import scheme_from_config

        scheme_from_config(cfg)  # the scheme's own checks of its settings, before any rank starts
        refuse_layout(cfg, pipeline_ep(cfg, nproc))
    build_data(cfg)
    if args.resume:
        from moebal.train.checkpoint import find_checkpoints

        if not find_checkpoints(out):
            raise ConfigError(f"nothing to resume in {out}: it holds no checkpoint "
                              f"(run without --resume to start, or point --out at the run)")
    if args.resume_from:  # its manifest, as every rank will open it (the tensors' checksums are the ranks' to check)
        from moebal.train.checkpoint import (
            find_checkpoints,
            open_for_resume,
            step_of,
            supersede_newer,
            verify_checkpoint,
        )

        reader = open_for_resume(out, args.resume_from)
        assert reader is not None  # (a path: required)
        newer = [p for p in find_checkpoints(out) if step_of(p) > reader.step]
        if newer and reader.path.parent.resolve() == out.resolve() and reader.step < cfg.train.steps:
            # set aside here, before any rank starts: a restart of ranks that died before rank 0 got to it would
            # continue the newer line; verified whole first, so that a damaged checkpoint moves nothing
            verify_checkpoint(reader.path)
            supersede_newer(out, reader.step)
    argv = ["train", *args._argv]
    if args.out is None:
        argv += ["--out", str(out)]
    # restarted ranks continue from the newest complete checkpoint (or start over before the first one)
    restart = [] if args.resume or args.auto_resume else ["--auto-resume"]
    from moebal.train.rundir import LOCK_ENV, LOCK_NAME

    # the ranks work under this launcher's lock of the run directory
    return spawn_local(nproc, argv, env={LOCK_ENV: str((out / LOCK_NAME).resolve())},
                       max_restarts=args.max_restarts, restart_argv=restart)


def warmup_note(t: TrainConfig) -> str | None:
    """A line saying the learning rate never reaches `train.lr` (`train.warmup_steps` > `train.steps`: a short run
    under the default 30 warm-up steps), None otherwise (a warm-up as long as the run reaches it at the last step)."""
    if t.warmup_steps <= t.steps:
        return None
    return (f"train.warmup_steps {t.warmup_steps} > train.steps {t.steps}: the learning rate stays in its warm-up, "
            f"rising to {t.steps / t.warmup_steps:.3g} x train.lr at the last step, and never decays; set "
            f"train.warmup_steps below train.steps for the full schedule")


def run(args: argparse.Namespace) -> int:
    wall0 = time.perf_counter()
    check_env_world()  # a rank started by hand with a bad torchrun environment: one line, not a traceback or a hang
    cfg, out = resolve_config(args)
    refuse_cpu_only(cfg, pick_device().type)
    from moebal.train.spikes import injected_spike

    injected_spike()  # a bad MOEBAL_INJECT_SPIKE is one line, before any rank starts
    from moebal.train.checkpoint import prune_checkpoints
    from moebal.train.memory import check_fits_here, check_plan_here, resolve_shard_here
    from moebal.train.rundir import LOCK_ENV, lock_run_dir

    local = _local_ranks(cfg) if "RANK" not in os.environ else 1  # what this process starts here
    # an impossible size is one line, before anything is allocated or created
    check_fits_here(cfg, local)
    # parallel.shard auto (the default): the memory plan's choice, settled alike by the launcher and every rank
    # (config.yaml keeps it)
    cfg, line = resolve_shard_here(cfg, local)
    # the memory plan: each rank's predicted peak by term (docs/memory.md); --no-memory-check skips it
    if not getattr(args, "no_memory_check", False):
        check_plan_here(cfg, local)
    # a choice to shard is said once (by the launcher or a torchrun job's rank 0), after the plan's check: where
    # nothing fits its refusal is the one line; none, the run as it would be without sharding, goes unsaid
    said_once = "RANK" not in os.environ or (os.environ["RANK"] == "0" and LOCK_ENV not in os.environ)
    if line and cfg.parallel.shard != "none" and said_once:
        print(f"moebal: {line}", file=sys.stderr, flush=True)

    # one live job per run directory (docs/training.md, Guarantees); what a dead job left half-written goes
    with lock_run_dir(out) as lock:
        if lock.held:
            prune_checkpoints(out, keep=1 << 30)  # every .ckpt-*.tmp: no other job can be writing one
        return _run_locked(args, cfg, out, wall0)


def _run_locked(args: argparse.Namespace, cfg: Config, out: Path, wall0: float) -> int:
    # --auto-resume (restarted ranks: torchrun --max-restarts, or --nproc with --max-restarts) continues the run
    # from its newest complete checkpoint, or starts it over when there is none yet
    from moebal.train.checkpoint import find_checkpoints

    if args.auto_resume and args.resume_from and find_checkpoints(out):
        args.resume_from = None  # a restarted job begun from --resume-from: continue from its own newest checkpoint
    auto = bool(args.auto_resume) and not (args.resume or args.resume_from)
    if not (args.resume or args.resume_from or auto) and (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
    if (args.resume_from and not args.auto_resume and Path(args.resume_from).resolve().parent != out.resolve()
            and ((out / "metrics.jsonl").exists() or find_checkpoints(out))):
        raise ConfigError(f"{out} already holds a run, and --resume-from {args.resume_from} is a checkpoint of "
                          f"another run: continuing it here would replace this run's checkpoints and metrics; "
                          f"choose a new --out for it")
    if cfg.hf.export_to:
        from moebal.train.export import check_export

        check_export(cfg, out)  # before training, not after it
    nproc = _local_ranks(cfg) if "RANK" not in os.environ else 1
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0; got {args.max_restarts}")
    if args.max_restarts and nproc == 1 and "RANK" not in os.environ:  # a rank of a job is started with it
        raise ConfigError(f"--max-restarts {args.max_restarts} restarts the ranks of a --nproc N job (N > 1), and "
                          "this run is one process: leave it out, or continue a failed run with --resume")
    if nproc > 1:
        return _spawn(args, cfg, out, nproc)
    from moebal.train.spikes import train_with_rollbacks

    trainer = build_trainer(cfg, out, args.resume_from or bool(args.resume) or auto, auto)
    dims = trainer.ctx.dims if trainer.ctx.distributed else None
    try:
        return train_with_rollbacks(trainer, lambda ckpt, d: build_trainer(cfg, out, str(ckpt), False, d),
                                    lambda t: _train(t, cfg, out, args, wall0))
    finally:
        if dims is not None:
            dims.close()  # local for gloo: a released rank leaves without waiting for the others


def build_trainer(cfg: Config, out: Path, resume: bool | str, auto: bool, dims: ParallelDims | None = None) -> Trainer:
    """One trainer for every mode: a pipeline stage (parallel.pp > 1, or the one stage of a dynamism scheme's run:
    `Config.pipelined`), data x expert parallelism (a torchrun job), or one process. --auto-resume (`auto`) may
    find no checkpoint and start over. `dims`: the process groups of the job, when it has joined them already (a
    rollback)."""
    from moebal.train import Hook, Trainer
    from moebal.train.spikes import injected_spike

    hooks: list[Hook] = []
    spike = injected_spike()  # MOEBAL_INJECT_SPIKE: a real spike to test the recovery on (docs/training.md)
    if spike is not None:
        hooks.append(spike)
    if cfg.hf.export_to:
        from moebal.train.export import ExportHook

        hooks.append(ExportHook(cfg, out))
    if cfg.train.record_routing_every:
        from moebal.train.routing_log import RoutingRecorder

        hooks.append(RoutingRecorder(cfg.train.record_routing_every))
    if cfg.pipelined:
        from moebal.train.pipelined import pipeline_trainer

        return pipeline_trainer(cfg, out, resume=resume, require_checkpoint=not auto, hooks=hooks, dims=dims)
    ctx, model = None, None
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        from moebal.train.distributed import setup_parallel

        # --auto-resume may find no checkpoint and start over: then the run needs its initial weights
        ctx, model, parallel = setup_parallel(cfg, load_weights=not resume or auto, run_dir=out, resume=bool(resume),
                                              dims=dims)
        hooks = parallel + hooks
    else:
        from moebal.balance.experts import refuse_idle_plan_ahead

        refuse_idle_plan_ahead(cfg, 1, 1)
    return Trainer(cfg, out, resume=resume, model=model, hooks=hooks, ctx=ctx, require_checkpoint=not auto)


def _train(trainer: Trainer, cfg: Config, out: Path, args: argparse.Namespace, wall0: float) -> int:
    main = trainer.ctx.is_main
    stream = sys.stderr
    if main:
        params = sum(p.numel() for p in trainer.model.parameters()) / 1e6
        resumed = f", resumed at step {trainer.step}" if trainer.step else ""
        stream.write(f"moebal train: {cfg.name}, {trainer.data.corpus.train.n_tokens / 1e6:.1f}M training tokens "
                     f"({trainer.data.corpus.source}), {params:.1f}M parameters"
                     f"{' on rank 0' if trainer.ctx.distributed else ''}, {trainer.strategy.describe()}, "
                     f"{cfg.train.steps} steps, {cfg.train.precision}, run directory {out}{resumed}\n")
        if trainer.resume_note and not trainer.finished:
            for note in trainer.resume_note.splitlines():
                stream.write(f"moebal train: {note}\n")
        warm = warmup_note(cfg.train)
        if warm and not trainer.finished:
            stream.write(f"moebal train: {warm}\n")
        stream.flush()
    if trainer.finished:  # a resumed run that has nothing left: say so, keep its summary
        if main:
            stream.write(f"moebal train: {out} is at step {trainer.step} and train.steps is {cfg.train.steps}: "
                         f"nothing to train; give a larger --steps to continue the run\n")
        return 0
    result = trainer.train()
    result.wall_seconds = time.perf_counter() - wall0
    if result.released_at is not None:
        stream.write(f"moebal train: rank {trainer.ctx.dims.rank} released at step {result.released_at} "
                     f"(re-packed onto fewer stages); exiting\n")
        return 0
    if not main:
        return 0
    summary = {"steps": result.steps, "train_loss": result.train_loss, "val_loss": result.val_loss,
               "unigram_entropy": result.unigram_entropy, "val_ratio": result.val_ratio,
               "tokens": result.tokens, "tokens_per_s": result.tokens_per_s, "wall_seconds": result.wall_seconds,
               "train_seconds": result.train_seconds, "setup_seconds": result.setup_seconds,
               "load_imbalance": result.load_imbalance, "dropped": result.dropped,
               "stopped_early": result.stopped_early, "rollbacks": result.rollbacks,
               "run_dir": str(result.run_dir),
               **trainer.strategy.summary(trainer)}
    write_text_whole(out / "summary.json", json.dumps(summary, indent=1) + "\n")  # never a half-written summary
    print(json.dumps(summary) if args.json else "\n".join(summary_lines(result,
                                                                         trainer.strategy.summary_lines(summary))))
    return 0
