"""The training loop, one for every mode: a step strategy is the only thing that differs.

Per step: hooks' `before_step` (apply a plan decided after the previous step), the strategy's step (read a
batch, set the learning rate, forward + backward, synchronise, clip, AdamW step: `LocalStep` for one process
or data x expert parallelism, `PipelineStep` for this rank's pipeline stage; moebal/train/strategy.py), hooks'
`after_step` (observe -> plan -> apply), then, the same in every mode: validation when due (or when the time
limit ends the run), a metrics line, new plans into `plans.jsonl`, the progress display, a checkpoint when due.
A rank that a pipeline re-pack released leaves the loop at once and writes nothing more. A bad step (a loss or
gradient norm that is not finite, or a loss spike: `train.spike`) stops the run, or rolls it back to a
checkpoint past the batches around the spike (moebal/train/spikes.py).

Exact resume: the checkpoint holds weights, AdamW state, the data sampler's position, every RNG state, hook
states, the strategy's state (a pipeline's partition, costs and scheme) and the run's expert kernel (settled
once at start-up, moebal/train/kernels.py); validation runs inside a saved-and-restored RNG state, and the
learning rate is a function of the step, so a resumed run computes bit for bit what the uninterrupted run
would have. A checkpoint of any layout resumes under any other (weights go by logical name; per-rank state is
this rank's own under the same layout, rank 0's otherwise; `StepStrategy.saved_rank`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.config import Config, dump
from moebal.data import DataBundle, build_data
from moebal.errors import TrainingError
from moebal.fileio import write_text_whole
from moebal.models import noise
from moebal.train.checkpoint import (
    CheckpointReader,
    find_checkpoints,
    load_agreed,
    open_for_resume,
    restore_rng,
    retire_checkpoints,
    rng_state,
    step_of,
    supersede_newer,
)
from moebal.train.distributed import RunContext
from moebal.train.hooks import Hook
from moebal.train.metrics import MetricsLog
from moebal.train.progress import Progress
from moebal.train.spikes import Rollback, append_rollback, bad_step, read_rollbacks, remember, rollback_for
from moebal.train.strategy import StepStrategy

__all__ = ["RunResult", "Trainer", "default_device", "default_threads"]

RECENT_KEYS = ("loss", "load_imbalance", "dropped")
"""What the run's result reads of its last steps' records (`Trainer._result`)."""


def default_threads(processes: int = 1) -> int:
    """Cores available to this process divided among the processes sharing the machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(processes, 1))


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    run_dir: Path
    steps: int
    train_loss: float
    val_loss: float | None
    unigram_entropy: float
    tokens: int
    train_seconds: float
    wall_seconds: float
    setup_seconds: float
    load_imbalance: list[float] = field(default_factory=list)
    dropped: int = 0
    stopped_early: str | None = None
    """Why the run ended before train.steps (the time limit); None when it ran to the end."""
    released_at: int | None = None
    """The step after which a pipeline re-pack released this rank (it trained no further); None otherwise."""
    rollbacks: int = 0
    """Rollbacks the run has made (`train.spike.action: rollback`; the lines of its rollbacks.jsonl)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_seconds, 1e-9)

    @property
    def val_ratio(self) -> float | None:
        return None if self.val_loss is None else self.val_loss / self.unigram_entropy


class Trainer:
    """Builds data, model and optimizer for a config (or takes a `strategy` that holds them, a pipeline stage's);
    `train()` runs (or resumes) the loop."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, hooks: list[Hook] | None = None,
                 resume: bool | str | Path = False, device: torch.device | None = None,
                 model: torch.nn.Module | None = None, data: DataBundle | None = None,
                 ctx: RunContext | None = None, require_checkpoint: bool = True,
                 strategy: StepStrategy | None = None) -> None:
        """Without `strategy`, the local step over `model` (built from the config when None). A given
        `strategy` was built over `data` and the job of `ctx`."""
        from moebal.launch.spawn import job_age_s
        from moebal.train.memory import settle_shard

        t0 = time.perf_counter()
        self.created = t0 - job_age_s()
        """When the job started (perf_counter's clock): a restart's ranks count `train.time_limit_min` from the
        first attempt's start, which their launcher passes them."""
        self.device = device or default_device()
        # parallel.shard auto: the memory plan's choice, as `moebal train` (and a given strategy) settled it
        cfg = settle_shard(cfg, self.device)
        self.cfg, self.run_dir, self.hooks = cfg, Path(run_dir), list(hooks or [])
        self.ctx = ctx or RunContext()
        set_threads(cfg)
        ckpt = self._find_resume(resume, require_checkpoint)
        # read after `_find_resume`'s collective: rank 0 writes a rollback's line before it gets there again
        self.rollbacks = read_rollbacks(self.run_dir)
        self.loss_history: list[float] = []
        """The last `train.spike.window` good steps' losses (the spike test's reference; checkpointed)."""
        self.norm_history: list[float] = []
        """... and their gradient norms before clipping (`train.spike.grad_factor`'s reference; checkpointed)."""
        self._resumed_at: int | None = None
        self.resume_note: str | None = None
        """What a resume changes against the checkpoint's run, a line each: another learning-rate schedule
        (`optim.schedule_change`), other settings (`config.config_changes`)."""
        self.data = data or build_data(cfg)
        if strategy is None:
            strategy = self._local(model, load_weights=ckpt is None)
        self.strategy: StepStrategy = strategy
        self.step, self.tokens, self.train_seconds = 0, 0, 0.0
        self.last_val: float | None = None
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, cfg.train.steps // 10))
        """The last tenth of the run's steps, each only what the result reads (`RECENT_KEYS`): a full record
        carries per-layer expert counts, which at hundreds of experts and layers would add up on every rank."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sp = cfg.train.spike
        self.checkpointer = self.ctx.checkpointer(self.run_dir, cfg.train.keep_checkpoints, cfg.train.ckpt_async,
                                                  reach=sp.back if sp.action == "rollback" else 0)
        if ckpt is not None:
            self._restore(ckpt)
            if (self.ctx.is_main and ckpt.step < cfg.train.steps
                    and ckpt.path.parent.resolve() == self.run_dir.resolve()):
                supersede_newer(self.run_dir, ckpt.step)  # once it loaded: a failed resume keeps every checkpoint
        # the run's one expert kernel: the config's, the checkpoint's, or auto's rule; rank 0's on every rank
        self.kernels = self.strategy.settle_kernels(self, ckpt.state.get("kernels") if ckpt is not None else None)
        if self.ctx.is_main and not self.finished:  # a resumed run with nothing left keeps its record
            dump(cfg, self.run_dir / "config.yaml")
            if self.kernels is not None:
                write_text_whole(self.run_dir / "kernels.json", json.dumps({"experts": self.kernels}, indent=1) + "\n")
        self.setup_seconds = time.perf_counter() - t0

    def _local(self, model: torch.nn.Module | None, load_weights: bool) -> StepStrategy:
        from moebal.train.local import LocalStep

        self.ctx.check_batch(self.cfg.data.batch_size, self.cfg.train.grad_accum)
        seed_everything(self.cfg.train.seed)
        if model is None:
            from moebal.models import build_model

            model = build_model(self.cfg, load_weights=load_weights)
        return LocalStep(self.cfg, model, self.data, self.ctx, self.device)

    @property
    def model(self) -> torch.nn.Module:
        """This rank's trained module: the model, or its pipeline stage."""
        return self.strategy.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.strategy.optimizer

    @property
    def finished(self) -> bool:
        """The run has reached train.steps (a resumed run with nothing left to train)."""
        return self.step >= self.cfg.train.steps

    def moe_layers(self) -> list[torch.nn.Module]:
        get = getattr(self.model, "moe_layers", None)
        return list(get()) if get is not None else []

    def close(self) -> None:
        """Release the strategy's communication resources (the process groups stay with their owner)."""
        self.strategy.close()

    def barrier(self) -> None:
        """Wait for every rank still training (a rank a re-pack released is not waited for)."""
        self.strategy.barrier()

    # ---- resume -------------------------------------------------------------------------------------

    def _find_resume(self, resume: bool | str | Path, require: bool = True) -> CheckpointReader | None:
        """The checkpoint to resume from, the same on every rank (the run directory must be shared). Without
        one, `require=False` (--auto-resume: a restarted job killed before its first checkpoint) starts over."""
        reader = open_for_resume(self.run_dir, resume, self.ctx.gather if self.ctx.distributed else None, require)
        if resume is not False and reader is None:  # starting over: the failed attempt's lines go
            self._cut_logs(0)
        return reader

    def _cut_logs(self, step: int) -> None:
        """Drop what a run wrote after `step` (its checkpoint, or 0 when starting over): the lines of metrics.jsonl,
        plans.jsonl and every rank's comm/rank<r>.jsonl, and the routing samples. One writer per file: each rank
        its own comm log, rank 0 the rest, with the comm logs of ranks this job no longer has."""
        from moebal.train.routing_log import cut_routing

        run, rank, world = self.run_dir, self.ctx.dims.rank, self.ctx.dims.world_size
        MetricsLog.truncate_after(run / "comm" / f"rank{rank}.jsonl", step)
        if not self.ctx.is_main:
            return
        for name in ("metrics.jsonl", "plans.jsonl"):
            MetricsLog.truncate_after(run / name, step)
        for path in sorted((run / "comm").glob("rank*.jsonl")):
            r = path.stem.removeprefix("rank")
            if r.isdigit() and int(r) >= world:
                MetricsLog.truncate_after(path, step)
        cut_routing(run, step)

    def _restore(self, reader: CheckpointReader) -> None:
        """Load under any layout: weights and optimizer state by logical name (experts follow their owner), the
        strategy's state (read and checked before anything is applied), the data position (global), and RNG
        and hook states (`StepStrategy.saved_rank`'s)."""
        gather = self.ctx.gather if self.ctx.distributed else None
        # expert weights sharded at rest are written one MoE layer at a time in `apply` (gathered, written, taken
        # by the owned parts, freed)
        pending = load_agreed(reader, self.strategy.module, self.strategy.optimizer, gather)
        s = reader.state
        self.strategy.read_state(reader)
        self.data.train.load_state_dict(s["data"])  # checks the data fits before anything is applied
        rollback = rollback_for(self.rollbacks, reader.step)
        if rollback is not None:  # the run went back to this checkpoint: its skipped batches stay skipped
            self.data.train.load_state_dict(rollback["data"])
            for _ in range(int(rollback["skip_extra"])):
                self.data.train.next_samples()
        for hook in self.hooks:
            hook.read_tensors(reader)
        pending.apply()
        self.step, self.tokens, self.train_seconds = reader.step, int(s["tokens"]), float(s["train_seconds"])
        self.last_val = s.get("last_val")
        self.loss_history = [float(x) for x in s.get("loss_history", [])]
        self.norm_history = [float(x) for x in s.get("grad_norm_history", [])]  # (none in older checkpoints)
        self._recent.clear()  # the result's last tenth of steps spans the resume (none in older checkpoints)
        self._recent.extend(s.get("recent", []))
        self._resumed_at = reader.step
        self.strategy.apply_state(reader)
        mine = s["ranks"][self.strategy.saved_rank(s)]
        for hook in self.hooks:
            hook.load_state_dict(mine.get("hooks", {}).get(hook.name, {}))
        restore_rng(mine["rng"])
        self._cut_logs(reader.step)  # one writer per file: another rank rewriting it could drop its new lines
        if self.ctx.is_main:
            self.resume_note = _resume_notes(reader.path, self.cfg, reader.step)

    def save(self) -> Path:
        """Checkpoint the current step (in the background with `train.ckpt_async`); the newest
        `keep_checkpoints` are kept."""
        global_state = {"data": self.strategy.data_state(), "tokens": self.tokens,
                        "train_seconds": self.train_seconds, "last_val": self.last_val, "kernels": self.kernels,
                        "loss_history": self.loss_history, "grad_norm_history": self.norm_history,
                        "recent": list(self._recent)}
        rank_state = {"rng": rng_state(), "hooks": {h.name: h.state_dict() for h in self.hooks},
                      **self.strategy.rank_state()}
        self.checkpointer.ranks = self.strategy.writing_ranks()  # a released rank is not waited for
        path = self.checkpointer.save(self.step, self.strategy.module, self.strategy.optimizer,
                                      global_state=global_state, rank_state=rank_state, config_yaml=dump(self.cfg),
                                      layout=self.strategy.layout(), extra=self._extra_tensors())
        return path

    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        """The strategy's and the hooks' checkpoint tensors beyond weights and optimizer state."""
        out = self.strategy.extra_tensors()
        for hook in self.hooks:
            mine = hook.extra_tensors()
            assert not out.keys() & mine.keys(), f"hook {hook.name} writes checkpoint tensors others write"
            out = {**out, **mine}
        return out

    # ---- one step -----------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        """One step of the strategy between the hooks; returns its metrics record."""
        step = self.step + 1
        # the step's time includes its hooks' work, as a pipeline's does: expert placement's Trans before the
        # step, the placement planner and the step's bookkeeping after it
        t0 = time.perf_counter()
        for hook in self.hooks:
            hook.before_step(self, step)
        with noise.step_key(self.cfg.train.seed, step):  # router noise keyed by step (moebal/models/noise.py)
            out = self.strategy.train_step(self, step)
        self.step, self.tokens = step, self.tokens + out.tokens
        record = out.record
        record["time"] = round(time.time(), 3)  # wall clock (recovery times, plots)
        if not self.strategy.released:
            for hook in self.hooks:
                hook.after_step(self, step, out.stats, record)
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        for key, value in (("tokens", self.tokens), ("tokens_per_s", round(out.tokens / dt, 1)),
                           ("step_time_s", round(dt, 4))):
            record.setdefault(key, value)  # a pipeline's record has its own (per-step tokens)
        return record

    # ---- validation ---------------------------------------------------------------------------------

    def evaluate(self) -> float | None:
        """Token-weighted mean loss over the fixed validation batches, forward only; RNG state untouched."""
        if not self.data.val:
            return None
        saved = rng_state()
        try:
            total, n = self.strategy.evaluate(self)
        finally:
            restore_rng(saved)
        return total / max(n, 1)

    # ---- the loop -----------------------------------------------------------------------------------

    def _due(self, every: int, step: int) -> bool:
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def out_of_time(self) -> bool:
        """`train.time_limit_min` has passed since the job's start (on any rank: every rank stops at the same
        step); a restarted job's ranks count from its first attempt's start."""
        limit = self.cfg.train.time_limit_min
        if limit is None:
            return False
        return self.strategy.agree_any(time.perf_counter() - self.created >= 60.0 * limit)

    def _write_plans(self) -> None:
        plans = self.strategy.new_plans()
        if plans:
            with (self.run_dir / "plans.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(p) + "\n" for p in plans)

    def train(self, stop_after: int | None = None) -> RunResult:
        """Run to `train.steps` (or stop after step `stop_after`, checkpointing there, as an interruption would).

        The time limit, when set, ends the run early but otherwise like a finished one (validation, checkpoint,
        dashboard); `RunResult.stopped_early` says so. A rank a re-pack released returns at once with
        `RunResult.released_at` set."""
        t = self.cfg.train
        wall0 = time.perf_counter()
        self.strategy.start(self)
        for hook in self.hooks:
            hook.on_start(self)
        main = self.ctx.is_main
        progress = Progress(t.steps, self.step, t.progress if main else "off")
        log = MetricsLog(self.run_dir / "metrics.jsonl") if main else None
        timed_out = False
        try:
            while self.step < t.steps and not self.strategy.released:  # (a resumed re-pack may release at once)
                record = self.train_step()
                if self.strategy.released:
                    break
                timed_out = self.out_of_time()
                if self._due(t.eval_every, self.step) or timed_out:
                    self.last_val = record["val_loss"] = self.evaluate()
                self._recent.append({k: record[k] for k in RECENT_KEYS if k in record})
                # every rank holds the same reduced loss and norm, so every rank calls the same step bad
                bad = bad_step(record.get("loss"), record.get("grad_norm"), self.loss_history, t.spike,
                               self.norm_history)
                if log is not None and (self.step % t.log_every == 0 or "val_loss" in record
                                        or self.step == t.steps or bad):
                    log.write(record)
                if bad:
                    raise self._bad_step(record, *bad)
                self.loss_history = remember(self.loss_history, record.get("loss"), t.spike.window)
                self.norm_history = remember(self.norm_history, record.get("grad_norm"), t.spike.window)
                if main:
                    self._write_plans()
                progress.update(self.step, record["loss"], record["tokens_per_s"], record.get("val_loss"))
                interrupted = stop_after is not None and self.step >= stop_after
                if self._due(t.ckpt_every, self.step) or interrupted or timed_out:
                    self.save()
                if interrupted or timed_out:
                    break
        except BaseException:
            self.checkpointer.wait_quietly()  # let a save in flight finish; the loop's error is the one to see
            raise
        finally:
            progress.close()
            if log is not None:
                log.close()
        self.checkpointer.wait()  # the last checkpoint is complete (or its error raised) before the run ends
        released = self.strategy.released
        if not released and (self.step >= t.steps or timed_out):
            for hook in self.hooks:
                hook.on_end(self)
            if main:
                self._write_dashboard()
                self.strategy.finish(self)
        result = self._result(time.perf_counter() - wall0)
        if released:
            result.released_at = self.step
        elif timed_out and self.step < t.steps:
            result.stopped_early = f"train.time_limit_min={t.time_limit_min} reached after step {self.step}/{t.steps}"
        return result

    def _bad_step(self, record: dict[str, Any], kind: str, why: str) -> TrainingError:
        """What a bad step raises: a `Rollback` to a checkpoint (`train.spike.action: rollback`, while
        rollbacks are left), else the error that stops the run. Either way its optimizer step has already
        applied the step's gradients, so nothing of this state is saved, and the checkpoints written so far
        (each at a step checked good) are left as they are."""
        self.checkpointer.wait_quietly()  # a save in flight (train.ckpt_async) completes and is listed
        # ... on every rank before any lists: rank 0 publishes a checkpoint (renames it into place) after every
        # rank's part is written, so a rank listing while rank 0's rename was on its way rolled back one
        # checkpoint further, by timing (a rollback's target, and so the run after it, depended on the load)
        self.ctx.gather(None)
        sp = self.cfg.train.spike
        if sp.action == "stop":
            return self._stop(kind, why, "")
        if len(self.rollbacks) >= sp.max_rollbacks:
            return self._stop(kind, why, f"the run has made its train.spike.max_rollbacks ({sp.max_rollbacks}) "
                                         f"rollbacks")
        if len(self.strategy.writing_ranks()) < self.ctx.dims.world_size:
            return self._stop(kind, why, "a re-pack released ranks, which a rollback cannot bring back")
        # the newest checkpoint at least `back` steps old (else the oldest kept) that every rank sees (an async
        # save's last rename may still be on its way)
        kept = [step_of(p) for p in find_checkpoints(self.run_dir)]
        old_enough = [s for s in kept if s <= self.step - sp.back]
        mine = max(old_enough) if old_enough else min(kept, default=-1)
        resume_step = min(self.ctx.gather(mine))
        if resume_step < 0:
            return self._stop(kind, why, "there is no checkpoint to roll back to")
        return self._rollback(record, why, resume_step)

    def _rollback(self, record: dict[str, Any], why: str, resume_step: int) -> Rollback:
        """Record the rollback to checkpoint `resume_step` (rank 0, on disk before any rank reloads) and say it."""
        sp = self.cfg.train.spike
        skipped = self.step - resume_step + sp.skip_extra
        previous = rollback_for(self.rollbacks, resume_step) if self._resumed_at == resume_step else None
        if previous is not None:  # a second rollback to the same checkpoint skips the first one's batches too
            skipped += int(previous["skipped_batches"])
        entry = {"step": self.step, "reason": why, "loss": record.get("loss"), "grad_norm": record.get("grad_norm"),
                 "resume_step": resume_step, "skipped_batches": skipped, "skip_extra": sp.skip_extra,
                 "data": self.strategy.data_state(), "time": record.get("time")}
        retired: list[str] = []
        if self.ctx.is_main:
            # the checkpoints after the one gone back to (train.spike.back) hold the abandoned line of the run: out
            # of a restart's reach before the record is written (a crash between the two retrains the spike's
            # batches from the right checkpoint; the other order would resume the abandoned line)
            retired = retire_checkpoints(self.run_dir, resume_step, "rolled-back")
            append_rollback(self.run_dir, {**entry, "retired": retired})
        path = self.run_dir / f"ckpt-{resume_step:07d}"
        batches = f"{skipped} batch{'es' if skipped != 1 else ''}"
        moved = (f"; the {len(retired)} checkpoint{'s' if len(retired) != 1 else ''} after it moved to "
                 f"{self.run_dir / Path(retired[0]).parent}" if retired else "")
        return Rollback(f"step {self.step}: {why}: rolled back to {path} (rollback {len(self.rollbacks) + 1} of at "
                        f"most {sp.max_rollbacks}), skipping {batches}{moved}", entry, path)

    def _stop(self, kind: str, why: str, no_rollback: str) -> TrainingError:
        """The error of a bad step that ends the run (`no_rollback`: why a rollback was not made); the message
        names the newest checkpoint and what to change."""
        found = find_checkpoints(self.run_dir)
        t = self.cfg.train
        where = (f"the newest checkpoint, {found[-1]}, is untouched: continue from it with `moebal train --out "
                 f"{self.run_dir} --resume` (or from an earlier one with --resume-from, if the loss had already "
                 f"gone bad there) and a change below as an override" if found else
                 "no checkpoint was written before it: start again with a change below")
        clip = "above 0" if t.grad_clip <= 0 else f"below {t.grad_clip}"
        changes = f"train.lr lower than {t.lr}, train.grad_clip {clip}, train.warmup_steps longer than {t.warmup_steps}"
        if t.spike.action == "stop":
            changes += ", or train.spike.action=rollback to skip the batches around it"
        what = "training diverged" if kind == "diverged" else "the loss spiked"
        return TrainingError(f"step {self.step}: {why}: {what} and stopped without saving this state"
                             f"{f' ({no_rollback})' if no_rollback else ''}; {where} ({changes})")

    def _write_dashboard(self) -> None:
        from moebal.train.dashboard import read_dashboard_records, write_dashboard

        write_dashboard(read_dashboard_records(self.run_dir / "metrics.jsonl"), self.run_dir / "dashboard.svg",
                        entropy=self.data.corpus.unigram_entropy, title=f"{self.cfg.name}: {self.run_dir.name}")

    def _result(self, wall: float) -> RunResult:
        recent = list(self._recent) or [{"loss": float("nan")}]
        imbalance = [float(np.mean(col)) for col in zip(*(r["load_imbalance"] for r in recent
                                                           if "load_imbalance" in r))]
        return RunResult(run_dir=self.run_dir, steps=self.step,
                         train_loss=float(np.mean([r["loss"] for r in recent])), val_loss=self.last_val,
                         unigram_entropy=self.data.corpus.unigram_entropy, tokens=self.tokens,
                         train_seconds=self.train_seconds, wall_seconds=wall, setup_seconds=self.setup_seconds,
                         load_imbalance=imbalance, dropped=sum(sum(r.get("dropped", [])) for r in recent),
                         rollbacks=len(self.rollbacks))


def set_threads(cfg: Config) -> None:
    """torch's intra-op threads: `train.threads`, or this machine's cores divided among its ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.nproc or 1))  # ranks on this machine (torchrun)
    torch.set_num_threads(cfg.train.threads or default_threads(local))


def _resume_notes(ckpt: Path, cfg: Config, step: int) -> str | None:
    """What this resume changes against the checkpoint's own config.yaml (read once), a line each: another
    learning-rate schedule (`optim.schedule_change`), other settings (`config.config_changes`); None when nothing
    does, or the checkpoint has no readable config.yaml."""
    import dataclasses

    from moebal.config import config_changes, load_data
    from moebal.errors import ConfigError
    from moebal.train.optim import SCHEDULE_KEYS, schedule_change

    try:
        saved = load_data(ckpt / "config.yaml")[0]
    except (OSError, ConfigError):
        return None
    notes = []
    train = saved.get("train") or {}
    with contextlib.suppress(TypeError):  # a saved key of another type: no schedule to compare
        notes.append(schedule_change(dataclasses.replace(cfg.train, **{k: train[k] for k in SCHEDULE_KEYS
                                                                        if k in train}), cfg.train, step))
    changed = config_changes(saved, cfg)
    if changed:
        notes.append(f"resumed with settings other than the checkpoint's, from the next step on: {', '.join(changed)}")
    return "\n".join(n for n in notes if n) or None
