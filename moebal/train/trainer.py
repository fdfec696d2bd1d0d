"""The training loop: one process, one device; distribution, planners and pipelines plug in as hooks.

Per step: read a batch, set the learning rate, forward + backward (`forward_backward`, the override point
of a pipeline engine), hooks' `after_backward` (gradient synchronisation), clip, AdamW step, then the step's
one routing-statistics point (`_routing_step`: take every MoE layer's accumulated stats, let hooks reduce
them, apply the auxiliary-loss-free bias update, read them to numbers), hooks' `after_step`
(observe -> plan -> apply), validation when due, a metrics line, a checkpoint when due.

Exact resume: the checkpoint holds weights, AdamW state, the data sampler's position, every RNG state,
hook states and the run's expert kernel (settled once at start-up, moebal/train/kernels.py); validation runs
inside a saved-and-restored RNG state, and the learning rate is a function of the step, so a resumed run
computes bit for bit what the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.config import Config, dump
from moebal.data import Batch, DataBundle, build_data
from moebal.data.curriculum import row_complexity
from moebal.routing import RoutingStats
from moebal.sync import to_host
from moebal.train.checkpoint import (
    CheckpointReader,
    load_agreed,
    open_for_resume,
    restore_rng,
    rng_state,
)
from moebal.train.distributed import RunContext
from moebal.train.hooks import Hook
from moebal.train.kernels import settle_expert_kernel
from moebal.train.metrics import MetricsLog, read_metrics, read_routing, routing_record
from moebal.train.optim import build_optimizer, lr_at
from moebal.train.precision import uses_bf16
from moebal.train.progress import Progress

__all__ = ["RunResult", "Trainer", "default_device", "default_threads"]


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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.train_seconds, 1e-9)

    @property
    def val_ratio(self) -> float | None:
        return None if self.val_loss is None else self.val_loss / self.unigram_entropy


class Trainer:
    """Builds data, model and optimizer for a config; `train()` runs (or resumes) the loop."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, hooks: list[Hook] | None = None,
                 resume: bool | str | Path = False, device: torch.device | None = None,
                 model: torch.nn.Module | None = None, data: DataBundle | None = None,
                 ctx: RunContext | None = None, require_checkpoint: bool = True) -> None:
        self.created = t0 = time.perf_counter()
        self.cfg, self.run_dir, self.hooks = cfg, Path(run_dir), list(hooks or [])
        self.ctx = ctx or RunContext()
        self.ctx.check_batch(cfg.data.batch_size)
        self.device = device or default_device()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.nproc or 1))  # ranks on this machine (torchrun)
        torch.set_num_threads(cfg.train.threads or default_threads(local))
        ckpt = self._find_resume(resume, require_checkpoint)
        self.data = data or build_data(cfg)
        seed_everything(cfg.train.seed)
        if model is None:
            from moebal.models import build_model

            model = build_model(cfg, load_weights=ckpt is None)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.step, self.tokens, self.train_seconds = 0, 0, 0.0
        self.last_val: float | None = None
        self._recent: list[dict[str, Any]] = []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer = self.ctx.checkpointer(self.run_dir, cfg.train.keep_checkpoints, cfg.train.ckpt_async)
        self.checkpoint_times: list[dict[str, float]] = []
        if ckpt is not None:
            self._restore(ckpt)
        # the run's one expert kernel: the config's, the checkpoint's, or auto's rule; rank 0's on every rank
        self.kernels = settle_expert_kernel(self.model, cfg, self.device,
                                            self.ctx.gather if self.ctx.distributed else None,
                                            ckpt.state.get("kernels") if ckpt is not None else None)
        if self.ctx.is_main:
            dump(cfg, self.run_dir / "config.yaml")
            if self.kernels is not None:
                (self.run_dir / "kernels.json").write_text(json.dumps({"experts": self.kernels}, indent=1) + "\n",
                                                           encoding="utf-8")
        self.setup_seconds = time.perf_counter() - t0

    # ---- resume -------------------------------------------------------------------------------------

    def _find_resume(self, resume: bool | str | Path, require: bool = True) -> CheckpointReader | None:
        """The checkpoint to resume from, the same on every rank (the run directory must be shared). Without
        one, `require=False` (--auto-resume: a restarted job killed before its first checkpoint) starts over."""
        reader = open_for_resume(self.run_dir, resume, self.ctx.gather if self.ctx.distributed else None, require)
        if resume is not False and reader is None and self.ctx.is_main:  # starting over: the failed attempt's
            MetricsLog.truncate_after(self.run_dir / "metrics.jsonl", 0)  # lines go (plans: its hook)
        return reader

    def _restore(self, reader: CheckpointReader) -> None:
        """Load under any layout: weights and optimizer state by logical name (experts follow their owner), the
        data position (global), and RNG and hook states (this rank's own when the layout is the same, rank 0's
        otherwise: random draws per rank cannot be mapped between layouts)."""
        gather = self.ctx.gather if self.ctx.distributed else None
        pending = load_agreed(reader, self.model, self.optimizer, gather)
        s = reader.state
        self.data.train.load_state_dict(s["data"])  # checks the data fits before anything is applied
        pending.apply()
        self.step, self.tokens, self.train_seconds = reader.step, int(s["tokens"]), float(s["train_seconds"])
        self.last_val = s.get("last_val")
        same = s.get("layout") == self.ctx.layout()
        mine = s["ranks"][str(self.ctx.dims.rank) if same else "0"]
        for hook in self.hooks:
            hook.load_state_dict(mine.get("hooks", {}).get(hook.name, {}))
        restore_rng(mine["rng"])
        if self.ctx.is_main:  # one writer: another rank rewriting the file could drop rank 0's new lines
            MetricsLog.truncate_after(self.run_dir / "metrics.jsonl", reader.step)

    def save(self) -> Path:
        """Checkpoint the current step (in the background with `train.ckpt_async`); the newest
        `keep_checkpoints` are kept."""
        global_state = {"data": self.data.train.state_dict(), "tokens": self.tokens,
                        "train_seconds": self.train_seconds, "last_val": self.last_val, "kernels": self.kernels}
        rank_state = {"rng": rng_state(), "hooks": {h.name: h.state_dict() for h in self.hooks}}
        path = self.checkpointer.save(self.step, self.model, self.optimizer, global_state=global_state,
                                      rank_state=rank_state, config_yaml=dump(self.cfg), layout=self.ctx.layout())
        self.checkpoint_times.append({"step": self.step, "blocked_s": self.checkpointer.last_blocked_s})
        return path

    # ---- one step -----------------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager[Any]:
        if uses_bf16(self.cfg, self.device):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def moe_layers(self) -> list[torch.nn.Module]:
        get = getattr(self.model, "moe_layers", None)
        return list(get()) if get is not None else []

    def forward_backward(self, batch: Batch, loss_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss and auxiliary loss of one batch, gradients accumulated (a pipeline engine overrides this).
        `loss_scale` weights this rank's mean-per-token loss by its share of the global batch's tokens."""
        with self.autocast():
            out = self.model(batch.ids_BT, batch.labels_BT)
        (out.loss * loss_scale + out.aux_loss).backward()
        return out.loss.detach(), out.aux_loss.detach()

    def _routing_step(self) -> list[RoutingStats]:
        """The step's one point for routing statistics: take, reduce (hooks), bias update."""
        layers = self.moe_layers()
        stats = [layer.take_stats() for layer in layers]
        for hook in self.hooks:
            stats = hook.reduce_stats(self, stats)
        for layer, s in zip(layers, stats):
            if getattr(layer, "expert_bias", None) is not None:
                layer.update_bias(s.routed_E)
        return stats

    def _record_complexity(self, global_batch: Batch, batch: Batch) -> None:
        """`data.order: complexity`: the batch's per-sample two-expert token shares into the curriculum (the same
        table on every rank: the rows are gathered), which orders the next epoch (moebal/data/curriculum.py)."""
        sampler = self.data.train
        curriculum = getattr(sampler, "curriculum", None)
        if curriculum is None:
            return
        local = row_complexity(self.moe_layers(), batch.labels_BT)
        C_BL = self.ctx.global_rows(local, global_batch.ids_BT.shape[0])
        tokens = (global_batch.labels_BT != -100).sum(dim=1).tolist()
        curriculum.record(sampler.last_ids, C_BL, tokens, at=sampler.position)

    def train_step(self) -> dict[str, Any]:
        step = self.step + 1
        for hook in self.hooks:
            hook.before_step(self, step)
        t0 = time.perf_counter()
        global_batch = self.data.train.next_batch()
        batch, scale = self.ctx.shard(global_batch)
        batch = batch.to(self.device)
        lr = lr_at(step - 1, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss, aux = self.forward_backward(batch, scale)
        self._record_complexity(global_batch, batch)
        for hook in self.hooks:
            hook.after_backward(self, step)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        grad_norm = self.ctx.clip_grad_norm(self.model, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._routing_step()
        loss_v, aux_v, norm_v = to_host(torch.stack([t.detach().to(loss.device, torch.float64)
                                                     for t in (loss, aux, grad_norm)]), "step losses")
        record: dict[str, Any] = {"step": step, "loss": self.ctx.mean(loss_v * scale),
                                  "aux_loss": self.ctx.mean(aux_v), "lr": lr, "grad_norm": norm_v}
        record.update(routing_record(read_routing(stats)))
        dt = time.perf_counter() - t0
        n = global_batch.n_tokens
        self.step, self.tokens, self.train_seconds = step, self.tokens + n, self.train_seconds + dt
        record.update(tokens=self.tokens, tokens_per_s=round(n / dt, 1), step_time_s=round(dt, 4),
                      time=round(time.time(), 3))
        for hook in self.hooks:
            hook.after_step(self, step, stats, record)
        return record

    # ---- validation ---------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Token-weighted mean loss over the fixed validation batches; RNG state untouched."""
        if not self.data.val:
            return None
        saved = rng_state()
        self.model.eval()
        total, n = 0.0, 0
        try:
            for batch in self.data.val:
                b = self.ctx.shard(batch)[0].to(self.device)
                with self.autocast():
                    out = self.model(b.ids_BT, b.labels_BT)
                total += out.loss.item() * b.n_tokens
                n += b.n_tokens
        finally:
            self.model.train()
            restore_rng(saved)
        total, n = self.ctx.sum([total, float(n)])
        return total / max(n, 1)

    # ---- the loop -----------------------------------------------------------------------------------

    def _due(self, every: int, step: int) -> bool:
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def out_of_time(self) -> bool:
        """`train.time_limit_min` has passed since start-up (on any rank: every rank stops at the same step)."""
        limit = self.cfg.train.time_limit_min
        if limit is None:
            return False
        late = float(time.perf_counter() - self.created >= 60.0 * limit)
        return self.ctx.sum([late])[0] > 0

    def train(self, stop_after: int | None = None) -> RunResult:
        """Run to `train.steps` (or stop after step `stop_after`, checkpointing there, as an interruption would).

        The time limit, when set, ends the run early but otherwise like a finished one (validation, checkpoint,
        dashboard); `RunResult.stopped_early` says so."""
        t = self.cfg.train
        wall0 = time.perf_counter()
        for hook in self.hooks:
            hook.on_start(self)
        main = self.ctx.is_main
        progress = Progress(t.steps, self.step, t.progress if main else "off")
        log = MetricsLog(self.run_dir / "metrics.jsonl") if main else None
        timed_out = False
        try:
            while self.step < t.steps:
                record = self.train_step()
                timed_out = self.out_of_time()
                if self._due(t.eval_every, self.step) or timed_out:
                    self.last_val = record["val_loss"] = self.evaluate()
                self._recent = (self._recent + [record])[-max(1, t.steps // 10):]
                if log is not None and (self.step % t.log_every == 0 or "val_loss" in record
                                        or self.step == t.steps):
                    log.write(record)
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
        if self.step >= t.steps or timed_out:
            for hook in self.hooks:
                hook.on_end(self)
            if main:
                self._write_dashboard()
        result = self._result(time.perf_counter() - wall0)
        if timed_out and self.step < t.steps:
            result.stopped_early = f"train.time_limit_min={t.time_limit_min} reached after step {self.step}/{t.steps}"
        return result

    def _write_dashboard(self) -> None:
        from moebal.train.dashboard import write_dashboard

        write_dashboard(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "dashboard.png",
                        entropy=self.data.corpus.unigram_entropy, title=f"{self.cfg.name}: {self.run_dir.name}")

    def _result(self, wall: float) -> RunResult:
        recent = self._recent or [{"loss": float("nan")}]
        imbalance = [float(np.mean(col)) for col in zip(*(r["load_imbalance"] for r in recent
                                                           if "load_imbalance" in r))]
        return RunResult(run_dir=self.run_dir, steps=self.step,
                         train_loss=float(np.mean([r["loss"] for r in recent])), val_loss=self.last_val,
                         unigram_entropy=self.data.corpus.unigram_entropy, tokens=self.tokens,
                         train_seconds=self.train_seconds, wall_seconds=wall, setup_seconds=self.setup_seconds,
                         load_imbalance=imbalance, dropped=sum(sum(r.get("dropped", [])) for r in recent))


