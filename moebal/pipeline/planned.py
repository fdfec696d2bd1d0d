"""Planned micro-batching on the pipeline engine: variable-size micro-batches run by instruction streams.

Shape legend: B = rows of a micro-batch (its size), T = its padded length, D = model dim.

One iteration on stage p of data-parallel replica d (`PlannedEngine.run_plan`):
  1. the plan (`microbatch.MicroBatchPlan`, the same on every rank) lists the replica's micro-batches in
     injection order, each as rows of sample indices padded to T tokens; every rank builds the tensors it
     needs from the global batch's samples (ids on the first stage, labels on the last, shapes elsewhere);
  2. the stage executes its instruction stream (`commplan.py`) in order:
       recv_act j    post a receive of (B_j, T_j, D) from stage p - 1          <- non-blocking
       wait_act j    wait for it                                             <- blocks
       F j           forward (`PipelineEngine._forward_compute`)
       send_act j    post the send of F(j)'s output to stage p + 1           <- non-blocking
       recv_grad j / wait_grad j / B j / send_grad j: the same for gradients, towards stage p - 1
       wait_send_act j, wait_send_grad j: the send's buffer may be freed
     The order of every post is the plan's global order, so no backend can deadlock on it (checked when the
     plan is made, `commplan.check_plan`); the shapes travel in the plan, nothing is negotiated.
Loss normalisation: per token. The last stage adds each micro-batch's summed token cross-entropy divided by
the *global* batch's label count, so the micro-batch losses sum to the mean loss per token of the whole
batch: the same loss and the same gradients as the samples in one batch, whatever the split (tested).
Padding positions carry label -100 and, right-padded under causal attention, never affect a real position.
MoE auxiliary losses are weighted by each micro-batch's share of the batch's real tokens.

`PlannedPipelineRunner` is the pipeline runner with this engine: it reads batches ahead, has them planned
(`planahead.py`), and records padding efficiency, micro-batch counts, the schedule and the exposed planning
time per step.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np
import torch

from moebal.balance.microbatch_workers import PlanAhead
from moebal.config import Config
from moebal.errors import ConfigError
from moebal.pipeline.engine import IterationResult, PipelineEngine, _Saved
from moebal.pipeline.runner import PipelineRunner
from moebal.planner.microbatch import MicroBatch, MicroBatchPlan
from moebal.planner.microbatch_cost import MicroBatchCost, analytic_table, default_grid, load_cost
from moebal.train.precision import compute_precision

__all__ = ["PlannedEngine", "PlannedPipelineRunner", "micro_batch_tensors", "planner_kwargs"]

IGNORE = -100


def micro_batch_tensors(samples: list[np.ndarray], mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BT, labels_BT) of a micro-batch: each row is its samples' (input, label) pairs concatenated (one
    sample per row unless packed), right-padded to T with id 0 and label -100."""
    ids = np.zeros((mb.size, mb.seq), dtype=np.int64)
    labels = np.full((mb.size, mb.seq), IGNORE, dtype=np.int64)
    for r, row in enumerate(mb.rows):
        pos = 0
        for i in row:
            x = samples[i]
            n = len(x) - 1
            ids[r, pos:pos + n] = x[:-1]
            labels[r, pos:pos + n] = x[1:]
            pos += n
        assert pos <= mb.seq, "a row is longer than its micro-batch's padded length"  # a plan bug
    return torch.from_numpy(ids), torch.from_numpy(labels)


class PlannedEngine(PipelineEngine):
    """The pipeline engine driven by a plan's instruction stream instead of a fixed schedule."""

    def run_plan(self, plan: MicroBatchPlan, replica: int, samples: list[np.ndarray], label_count: int,
                 device: torch.device) -> IterationResult:
        rep = plan.replicas[replica]
        mbs = [plan.micro_batches[g] for g in rep.micro_batches]
        total = max(sum(m.tokens for m in plan.micro_batches), 1)
        chain, D, dtype = self.chain, self.stage.cfg.model.dim, self._act_dtype()
        result = IterationResult(loss_sum=0.0, aux_by_layer={}, busy_s=0.0)
        self._cpu0 = 0.0
        inputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        saved: dict[int, _Saved] = {}
        grad_in: dict[int, torch.Tensor] = {}
        recvs: dict[tuple[str, int], Any] = {}
        sends: dict[tuple[str, int], Any] = {}
        for op, j in rep.streams[chain.index]:
            mb = mbs[j]
            if op == "recv_act":
                inputs[j] = torch.empty(mb.size, mb.seq, D, dtype=dtype, device=device)
                recvs[("act", j)] = chain.post_recv(inputs[j], chain.prev)
            elif op == "recv_grad":
                grads[j] = torch.empty_like(saved[j].out)
                recvs[("grad", j)] = chain.post_recv(grads[j], chain.next)
            elif op in ("wait_act", "wait_grad"):
                chain.wait_recv(recvs.pop((op[5:], j)))
            elif op == "F":
                ids, labels = (t.to(device) for t in micro_batch_tensors(samples, mb))
                saved[j] = self._forward_compute(j, ids, labels, label_count, mb.tokens / total, result,
                                                 inputs.pop(j, None), {})
            elif op == "B":
                g = self._backward_compute(j, saved.pop(j), grads.pop(j, None), result)
                if g is not None:
                    grad_in[j] = g
            elif op == "send_act":
                sends[("act", j)] = chain.post_send(saved[j].out, chain.next)
            elif op == "send_grad":
                sends[("grad", j)] = chain.post_send(grad_in.pop(j), chain.prev)
            elif op.startswith("wait_send_"):
                chain.wait_send(sends.pop((op[len("wait_send_"):], j)))
            else:
                raise ConfigError(f"unknown plan instruction {op!r}")
        assert not (recvs or sends or saved), "the instruction stream left transfers or activations behind"
        return result


def planner_kwargs(cfg: Config, dp: int) -> dict[str, Any]:
    """The plan_microbatches arguments of a run (method, memory, thinning, schedules, ...)."""
    p = cfg.pipeline
    return {"method": p.microbatching, "dp": dp, "memory": p.dynamic.memory, "max_len": cfg.data.seq_len,
            "pad_multiple": p.dynamic.pad_multiple, "thin": p.dynamic.thin,
            "schedules": tuple(x.strip() for x in p.dynamic.schedules.split(",") if x.strip())}


class PlannedPipelineRunner(PipelineRunner):
    """The pipeline runner with planned micro-batches (pipeline.microbatching dynamic, padding or packing)."""

    def __init__(self, cfg: Config, *, cost: MicroBatchCost | None = None, kwargs: dict[str, Any] | None = None,
                 workers: int | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        if self._planning():
            raise ConfigError("planned micro-batching with layer rebalancing or re-packing is not supported yet: "
                              "set pipeline.rebalance=off and pipeline.repack=false")
        if self.dims.ep > 1:
            raise ConfigError("planned micro-batching with expert parallelism inside stages (parallel.ep > 1) is not "
                              "supported yet: use parallel.ep=1 (the other ranks of a stage are data-parallel "
                              "pipelines, each planned its own micro-batches)")
        self.engine = PlannedEngine(self.stage, self.chain, self.scheme, "1f1b", 1, self.engine.autocast,
                                    aux_ranks=1)
        self.kwargs = kwargs or planner_kwargs(cfg, self.dp)
        self.lookahead = cfg.pipeline.dynamic.lookahead
        self.cost = cost if cost is not None else self._cost_table()
        n_workers = cfg.pipeline.dynamic.workers if workers is None else workers
        self.planner = PlanAhead.for_job(self.cost, self.kwargs, n_workers)
        self._ahead: collections.deque[tuple[int, list[np.ndarray]]] = collections.deque()
        self._read = 0
        self._positions: collections.deque[dict[str, Any]] = collections.deque()
        self._last: dict[str, Any] = {}

    # ---- costs ----
    def _cost_table(self) -> MicroBatchCost:
        """'measure': every rank profiles its own stage, gathered along the chain; a path; a hardware profile."""
        dyn, d = self.cfg.pipeline.dynamic, self.cfg.data
        max_tokens = dyn.max_tokens or 4 * d.seq_len
        b_grid, s_grid = default_grid(d.seq_len, max_tokens)
        if dyn.costs == "measure":
            from moebal.pipeline.microbatch_profile import profile_stage

            f, b, a = profile_stage(self.stage, b_grid, s_grid, max_tokens, device=self.device)
            mine = torch.from_numpy(np.stack([f, b, a]).reshape(-1))
            parts = self.chain.allgather_1d(mine)
            arr = torch.stack(parts).numpy().reshape(self.chain.size, 3, len(b_grid), len(s_grid))
            return MicroBatchCost(b_grid=b_grid, s_grid=s_grid, fwd_PBS=arr[:, 0], bwd_PBS=arr[:, 1],
                                  act_PBS=arr[:, 2], source="measured at start-up",
                                  meta={"sizes": list(self.sizes), "max_tokens": max_tokens})
        if dyn.costs.endswith(".json"):
            table = load_cost(dyn.costs)
            if table.stages != self.chain.size:
                raise ConfigError(f"pipeline.dynamic.costs {dyn.costs} has {table.stages} stages; this pipeline "
                                  f"has {self.chain.size}")
            return table
        from moebal.planner.cost import ModelShape

        return analytic_table(ModelShape.from_config(self.cfg), dyn.costs, list(self.sizes), b_grid, s_grid,
                              compute_precision(self.cfg.train.precision, self.device))

    def data_state(self) -> dict[str, Any]:
        """The data position of the next step to train (batches read ahead are read again on resume)."""
        return dict(self._positions[0]) if self._positions else self.data.train.state_dict()

    # ---- the step ----
    def _fill(self, step: int) -> None:
        """Read batches up to step + lookahead; the planning rank submits their lengths."""
        while self._read < step + self.lookahead:
            self._read += 1
            self._positions.append(self.data.train.state_dict())  # where batch _read starts (checkpoints)
            samples = self.data.train.next_samples()
            self._ahead.append((self._read, samples))
            self.planner.submit(self._read, [len(x) - 1 for x in samples])

    def _next_input(self) -> tuple[Any, int]:
        step = self.step + 1
        self._fill(step)
        s, samples = self._ahead.popleft()
        self._positions.popleft()
        assert s == step, "batches read ahead are out of step"
        plan, wait = self.planner.get(step)
        count = sum(len(x) - 1 for x in samples)
        self._last = {"plan_wait_s": round(wait, 6), "micro_batches": len(plan.micro_batches),
                      "padding_efficiency": round(plan.padding_efficiency, 4),
                      "computed_tokens": plan.computed_tokens, "schedule": plan.replicas[self.data_index].schedule,
                      "predicted_time_s": round(plan.predicted_time_s, 6), "plan_s": round(plan.meta["plan_s"], 6)}
        return (plan, samples), count

    def _run_engine(self, work: Any, count: int) -> IterationResult:
        plan, samples = work
        assert isinstance(self.engine, PlannedEngine)
        return self.engine.run_plan(plan, self.data_index, samples, count, self.device)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        record = super().train_step()
        record.update(self._last)
        record["exposed_planning"] = round(self._last["plan_wait_s"] / max(time.perf_counter() - t0, 1e-9), 4)
        return record

    def close(self) -> None:
        self.planner.close()
        super().close()
