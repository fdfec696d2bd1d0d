"""The local step: the whole model on this rank, alone or as one of a data x expert-parallel job.

Per step: read the global batch and keep this rank's rows (`RunContext.shard`), set the learning rate,
forward + backward, hooks' `after_backward` (gradient synchronisation, Pro-Prophet's Agg), clip by the global
norm, AdamW step, then the step's one routing-statistics point (`_routing_step`: take every MoE layer's
accumulated stats, let hooks reduce them, apply the auxiliary-loss-free bias update, read them to numbers).
With `parallel.shard: optimizer` the hooks leave gradients alone and the `ShardedAdamW`
(moebal/distributed/sharded.py) reduce-scatters them, clips by the global norm and all-gathers the weights;
with `parallel.shard: full` FSDP2 shards the dense weights and reduce-scatters their gradients in the backward
pass, and `FullyShardedAdamW` (moebal/distributed/fsdp.py) does the rest.
The trainer calls the hooks' `before_step` and `after_step` (observe -> plan -> apply) around it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moebal.config import Config
from moebal.data import Batch, DataBundle, DocumentSampler, PackedSampler, ordering_sampler
from moebal.data.curriculum import row_complexity
from moebal.models import noise, padding
from moebal.routing import RoutingStats
from moebal.sync import to_host
from moebal.train.distributed import RunContext
from moebal.train.kernels import settle_expert_kernel
from moebal.train.metrics import read_metrics, read_routing, routing_record
from moebal.train.optim import build_optimizer, lr_at
from moebal.train.precision import uses_bf16
from moebal.train.strategy import StepOutput

if TYPE_CHECKING:
    from moebal.distributed.fsdp import FullyShardedAdamW, StepHold
    from moebal.distributed.sharded import ShardedAdamW
    from moebal.models.moe import MoELayer
    from moebal.train.checkpoint import CheckpointReader
    from moebal.train.trainer import Trainer

__all__ = ["LocalStep", "placement_summary"]


class LocalStep:
    """`StepStrategy` of the whole model on this rank (moebal/train/strategy.py)."""

    released = False

    def __init__(self, cfg: Config, model: torch.nn.Module, data: DataBundle, ctx: RunContext,
                 device: torch.device) -> None:
        from moebal.train.memory import settle_shard

        cfg = settle_shard(cfg, device)  # parallel.shard auto: the memory plan's choice, as `moebal train`'s
        ctx.check_batch(cfg.data.batch_size, cfg.train.grad_accum)
        self.cfg, self.data, self.ctx, self.device = cfg, data, ctx, device
        self.micro_batches = cfg.train.grad_accum
        self.model = model.to(device)
        self._sharded: ShardedAdamW | FullyShardedAdamW | None = None
        self._hold: StepHold | None = None
        """`parallel.accumulate: whole` and `parallel.reshard: step` under `shard: full` with micro-batches: what
        FSDP2 holds whole through the step (moebal/distributed/fsdp.py `StepHold`)."""
        if cfg.parallel.shard == "optimizer" and ctx.distributed:
            from moebal.distributed.fsdp import DTYPES
            from moebal.distributed.sharded import ShardedAdamW

            # the hooks leave gradients unsynchronised (setup_parallel): this optimizer reduce-scatters them, in
            # parallel.reduce_dtype; with parallel.param_dtype bf16 it keeps the weights in bf16, fp32 masters
            self._sharded = ShardedAdamW(self.model, cfg.train, ctx.dims,
                                         param_dtype=DTYPES[cfg.parallel.param_dtype],
                                         reduce_dtype=DTYPES[cfg.parallel.reduce_dtype], accumulate=self.accumulates)
        elif cfg.parallel.shard == "full" and ctx.distributed:
            from moebal.distributed.fsdp import FullyShardedAdamW, StepHold, fsdp_units, fully_shard_model

            # dense weights, gradients and moments split by FSDP2 (which reduce-scatters their gradients in
            # the backward pass), expert ones by the sharded optimizer, after Agg
            fully_shard_model(self.model, cfg, ctx.dims)
            self._sharded = FullyShardedAdamW(self.model, cfg, ctx.dims, accumulate=self.accumulates)
            # the root (the model) keeps its weights after its forward by construction
            self._hold = StepHold.of(cfg, partial(fsdp_units, self.model), lambda m: m is not self.model)
        self._optimizer = self._sharded or build_optimizer(self.model, cfg.train)

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def accumulates(self) -> bool:
        """The step runs several micro-batches (`train.grad_accum` > 1)."""
        return self.micro_batches > 1

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def describe(self) -> str:
        d = self.ctx.dims
        where = f"{d.world_size} ranks (ep {d.ep})" if self.ctx.distributed else "one process"
        return where + (f", {self.micro_batches} micro-batches per step" if self.accumulates else "")

    def start(self, trainer: Trainer) -> None:
        """Nothing to measure: the hooks' `on_start` does the expert-parallel calibration."""

    # ---- one step ----
    def autocast(self) -> AbstractContextManager[Any]:
        if uses_bf16(self.cfg, self.device):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def moe_layers(self) -> list[MoELayer]:
        get = getattr(self.model, "moe_layers", None)
        return list(get()) if get is not None else []

    def _routing_step(self, trainer: Trainer) -> list[RoutingStats]:
        """The step's one point for routing statistics: take, reduce (hooks), bias update."""
        layers = self.moe_layers()
        stats = [layer.take_stats() for layer in layers]
        for hook in trainer.hooks:
            stats = hook.reduce_stats(trainer, stats)
        for layer, s in zip(layers, stats):
            if getattr(layer, "expert_bias", None) is not None:
                layer.update_bias(s.routed_E)
        return stats

    def _curriculum(self) -> PackedSampler | DocumentSampler | None:
        """The sampler, when it orders epochs by complexity (`data.order: complexity`); else None."""
        return ordering_sampler(self.data.train)

    def _record_complexity(self, global_batch: Batch, local: np.ndarray) -> None:
        """`data.order: complexity`: the batch's per-sample two-expert token shares into the curriculum (the same
        table on every rank: the rows are gathered), which orders the next epoch (moebal/data/curriculum.py).
        `local`: this rank's rows, measured after each micro-batch's forward."""
        sampler = self._curriculum()
        assert sampler is not None and sampler.curriculum is not None
        C_BL = self.ctx.global_rows(local, global_batch.ids_BT.shape[0])
        tokens = (global_batch.labels_BT != -100).sum(dim=1).tolist()
        sampler.curriculum.record(sampler.last_ids, C_BL, tokens, at=sampler.position)

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's rows (host tensors) as `train.grad_accum` equal micro-batches, in row order."""
        if not self.accumulates:
            return [batch]
        return [batch.part(j, self.micro_batches) for j in range(self.micro_batches)]

    def forward_backward(self, trainer: Trainer, step: int, batch: Batch, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Forward and backward of this rank's rows, in `train.grad_accum` micro-batches (one without it),
        gradients accumulating: micro-batch j's mean-per-token loss weighted by its share of the rank's tokens
        (the sum is the rank's mean, as one forward gives) times `scale` (the rank's share of the global batch's
        tokens), the auxiliary losses by 1 / count (each forward's own, global over the ranks of that forward). What
        sends gradients during the backward pass is armed for the last one only, when they are final sums: a
        sharded optimizer's buckets (`begin`; accumulating, it adds the earlier passes' fp32 sums of bf16
        compute copies), FSDP2's reduce-scatters under `parallel.accumulate: whole` (until then its dense
        gradients add up whole; `StepHold`, which also keeps the weights gathered under `parallel.reshard: step`)
        and hooks' `before_last_micro_batch`.
        Every rank runs every micro-batch, one with no label tokens too (its weight is 0): the MoE layers'
        exchanges need every rank's forward. Returns the rank's loss, the mean auxiliary loss and the
        per-micro-batch row complexities (`data.order: complexity`; none without it)."""
        host_parts = self._micro_batches(batch)
        parts = [part.to(self.device) for part in host_parts]  # split on the host: no device sync
        count, total = len(parts), max(batch.n_tokens, 1)
        loss = aux = torch.zeros((), device=self.device)
        rows: list[torch.Tensor] = []
        complexity = self._curriculum() is not None
        with self._hold.step() if self._hold is not None else nullcontext():
            for j, part in enumerate(parts):
                if j == count - 1:  # arm what sends gradients during the backward pass: only the last pass's
                    self._arm_last_pass(trainer, step, count)  # are the step's sums
                share = part.n_tokens / total
                labels_BT = host_parts[j].labels_BT  # the MoE losses leave out its padding
                with self.autocast(), noise.micro_batch_key(j), \
                        padding.rows(padding.rows_of_labels(labels_BT), labels_BT.shape[1]):
                    out = self.model(part.ids_BT, part.labels_BT)
                # a micro-batch without label tokens has a non-finite mean; its weight is 0 and it adds no
                # gradient
                part_loss = out.loss if part.n_tokens else out.loss.nan_to_num(0.0, 0.0, 0.0)
                (part_loss * (scale * share) + out.aux_loss / count).backward()
                loss = loss + part_loss.detach().float() * share
                aux = aux + out.aux_loss.detach().float() / count
                if complexity:
                    rows.append(row_complexity(self.moe_layers(), part.labels_BT))
        return loss, aux, rows

    def _arm_last_pass(self, trainer: Trainer, step: int, count: int) -> None:
        """Before the forward of the step's last micro-batch: what sends gradients during its backward pass."""
        if self._sharded is not None:
            self._sharded.begin()  # its buckets go out as their gradients complete
        if self._hold is not None:
            self._hold.last_backward()  # FSDP2: the whole sums out in this backward, the weights freed after it
        if count > 1:
            for hook in trainer.hooks:
                hook.before_last_micro_batch(trainer, step)

    def train_step(self, trainer: Trainer, step: int) -> StepOutput:
        global_batch = self.data.train.next_batch()
        batch, scale = self.ctx.shard(global_batch)
        lr = lr_at(step - 1, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss, aux, rows = self.forward_backward(trainer, step, batch, scale)
        if rows:  # one host read for the step's rows
            local = np.asarray(to_host(torch.cat(rows), "curriculum rows"), dtype=np.float64)
            self._record_complexity(global_batch, local.reshape(sum(len(r) for r in rows), rows[0].shape[1]))
        for hook in trainer.hooks:
            hook.after_backward(trainer, step)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        if self._sharded is not None:
            self._sharded.reduce()  # after Agg: the expert buckets, then every part averaged
            grad_norm = self._sharded.clip_grad_norm(clip)
        else:
            grad_norm = self.ctx.clip_grad_norm(self.model, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._routing_step(trainer)
        loss_v, aux_v, norm_v = to_host(torch.stack([t.detach().to(loss.device, torch.float64)
                                                     for t in (loss, aux, grad_norm)]), "step losses")
        record: dict[str, Any] = {"step": step, "loss": self.ctx.mean(loss_v * scale),
                                  "aux_loss": self.ctx.mean(aux_v), "lr": lr, "grad_norm": norm_v}
        record.update(routing_record(read_routing(stats)))
        return StepOutput(record, global_batch.n_tokens, stats)

    def routing_sample(self, trainer: Trainer, step: int) -> torch.Tensor | None:
        if not self.ctx.is_main:
            return None
        ids = [r.indices_TK for r in (getattr(m, "last_routing", None) for m in trainer.moe_layers()) if r is not None]
        return torch.stack(ids) if ids else None

    # ---- validation and agreement ----
    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> tuple[float, float]:
        self.model.eval()
        total, n = 0.0, 0
        try:
            for batch in self.data.val:
                b = self.ctx.shard(batch)[0].to(self.device)
                with self.autocast():
                    out = self.model(b.ids_BT, b.labels_BT)
                total += out.loss.item() * b.n_tokens if b.n_tokens else 0.0  # no labels: a mean of nothing
                n += b.n_tokens
        finally:
            self.model.train()
        total, count = self.ctx.sum([total, float(n)])
        return total, count

    def agree_any(self, flag: bool) -> bool:
        return self.ctx.sum([float(flag)])[0] > 0

    def barrier(self) -> None:
        if self.ctx.distributed:
            import torch.distributed as dist

            dist.barrier()

    # ---- checkpoints ----
    def layout(self) -> dict[str, Any]:
        return dict(self.ctx.layout())

    def writing_ranks(self) -> list[int]:
        return list(range(self.ctx.dims.world_size))

    def data_state(self) -> dict[str, Any]:
        return self.data.train.state_dict()

    def rank_state(self) -> dict[str, Any]:
        return {}

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def saved_rank(self, state: dict[str, Any]) -> str:
        """This rank's own state under the same layout, rank 0's otherwise (random draws per rank cannot be
        mapped between layouts)."""
        return str(self.ctx.dims.rank) if state.get("layout") == self.layout() else "0"

    def read_state(self, reader: CheckpointReader) -> None:
        """Nothing beyond weights, data, RNG and hooks."""

    def apply_state(self, reader: CheckpointReader) -> None:
        """Nothing beyond weights, data, RNG and hooks."""

    def settle_kernels(self, trainer: Trainer, recorded: dict[str, Any] | None) -> dict[str, Any] | None:
        return settle_expert_kernel(self.model, self.cfg, self.device,
                                    self.ctx.gather if self.ctx.distributed else None, recorded)

    # ---- the end ----
    def new_plans(self) -> list[dict[str, Any]]:
        return []  # the expert-parallel hook writes plans.jsonl itself

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        return {"placement": placement_summary(trainer.run_dir / "metrics.jsonl", self.cfg)}

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        p = summary.get("placement")
        if not p:
            return []
        return [f"  expert placement ({p['policy']}): rank load max/mean {p['rank_imbalance_before']:.2f} -> "
                f"{p['rank_imbalance_after']:.2f} with {p['replicas_per_step']:.1f} replicas per step; "
                f"planner {p['plan_ms']:.2f} ms; step {p['step_time_s']:.3f} s"]

    def finish(self, trainer: Trainer) -> None:
        """No plot beyond the trainer's dashboard."""

    def close(self) -> None:
        """The process groups belong to whoever built the run context; a sharded optimizer's hooks go."""
        if self._sharded is not None:
            self._sharded.close()


def placement_summary(metrics: Path, cfg: Config) -> dict[str, float | str] | None:
    """What expert placement did over the last 10% of steps: rank load max/mean before and after the plans
    (mean over MoE layers), replicas per step, planner time and the step time."""
    keys = ("rank_imbalance_before", "rank_imbalance_after", "replicas", "plan_ms", "step_time_s")
    # the expert-parallel trainer's lines only (a run resumed from a pipeline checkpoint also has the pipeline's)
    rows = [r for r in read_metrics(metrics, keys) if all(k in r for k in keys)] if metrics.is_file() else []
    if not rows:
        return None
    rows = rows[-max(1, len(rows) // 10):]

    def avg(key: str) -> float:
        vals = [sum(r[key]) / len(r[key]) if isinstance(r[key], list) else r[key] for r in rows]
        return round(float(sum(vals)) / len(vals), 4)

    return {"policy": cfg.planner.policy, "rank_imbalance_before": avg("rank_imbalance_before"),
            "rank_imbalance_after": avg("rank_imbalance_after"), "replicas_per_step": avg("replicas"),
            "plan_ms": avg("plan_ms"), "step_time_s": avg("step_time_s")}
