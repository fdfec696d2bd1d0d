"""Planned micro-batching on the pipeline engine: variable-size micro-batches run by instruction streams.

Shape legend: B = rows of a micro-batch (its size), T = its padded length, D = model dim.

One iteration on stage p of data-parallel replica d (`PlannedEngine.run_plan`):
  1. the plan (`microbatch.MicroBatchPlan`, the same on every rank) lists the replica's micro-batches in
     injection order, each as rows of sample indices padded to T tokens; every rank builds the tensors it
     needs from the global batch's samples (ids on the first stage, labels on the last, shapes elsewhere).
     A replica may be run by several lockstep ranks (`Lockstep`: expert shards, whose all-to-alls pair their
     micro-batches, or every rank of a stage whose MoE layers sum routing statistics at every micro-batch or
     whose state FSDP2 shards, `parallel.shard: full`):
     they execute the same stream, each on its `MicroBatch.part` of every micro-batch's rows (the plan gives
     each at least one row; token counts differ, the all-to-all takes uneven splits);
  2. the stage executes its instruction stream (`planner/instructions.py`) in order:
       recv_act j    post a receive of (B_j, T_j, D) from stage p - 1          <- non-blocking
       wait_act j    wait for it                                             <- blocks
       F j           forward (`PipelineEngine._forward_compute`)
       send_act j    post the send of F(j)'s output to stage p + 1           <- non-blocking
       recv_grad j / wait_grad j / B j / send_grad j: the same for gradients, towards stage p - 1
       wait_send_act j, wait_send_grad j: the send's buffer may be freed
     The order of every post is the plan's global order, so no backend can deadlock on it (checked when the
     plan is made, `instructions.check_plan`); the shapes travel in the plan, nothing is negotiated.
Loss normalisation: per token. The last stage adds each micro-batch's summed token cross-entropy divided by
the *global* batch's label count, so the micro-batch losses sum to the mean loss per token of the whole
batch: the same loss and the same gradients as the samples in one batch, whatever the split (tested).
Padding positions carry label -100 and, right-padded under causal attention, never reach a real position's
attention. They are routed like real tokens, though: under a capacity factor they take expert capacity, and they
count in the MoE auxiliary losses and the routing statistics (dropless routing leaves the real tokens' outputs
alone; the same holds for document-mode padding anywhere).
A dynamism scheme gets each padded row's real tokens in its carry (`ROW_TOKENS`, from the plan on every stage,
never sent): Mixture-of-Depths keeps the share of a row's real tokens, early exit counts only those.
MoE auxiliary losses are weighted by each micro-batch's share of the batch's real tokens (the whole
micro-batch's, all lockstep parts: its loss comes from their summed statistics, and each of the stage's n ranks
adds 1/n of it).

`PlannedPipelineRunner` is the pipeline runner with this engine: the micro-batch planner
(`balance/microbatches.py`) reads batches ahead and has them planned; the runner executes each step's plan and
records padding efficiency, micro-batch counts, the schedule and the exposed planning time per step. The layer
balancer runs as in the fixed runner (`pipeline.rebalance`): it profiles planned iterations, migrates layers,
and the micro-batch planner re-costs the following plans on the new partition.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebal.balance.microbatches import MicrobatchPlanner, planner_kwargs
from moebal.config import Config, planned_moe_losses
from moebal.data.curriculum import sample_complexity
from moebal.distributed.groups import ParallelDims
from moebal.dynamism.scheme import ROW_TOKENS, real_positions
from moebal.errors import ConfigError
from moebal.models import padding
from moebal.pipeline.engine import POOLED, IterationResult, PipelineEngine, _Saved, last_backward
from moebal.pipeline.runner import PipelineRunner
from moebal.planner.microbatch import MicroBatch, MicroBatchPlan
from moebal.planner.microbatch_cost import MicroBatchCost
from moebal.sync import upload

__all__ = ["Lockstep", "PlannedEngine", "PlannedPipelineRunner", "micro_batch_tensors", "padded_rows", "spans"]

IGNORE = -100


def spans(samples: list[np.ndarray], mb: MicroBatch,
          rows: tuple[tuple[int, ...], ...]) -> Iterator[tuple[int, int, int, int]]:
    """(row, first position, tokens, sample) of every sample in `rows` of micro-batch `mb`, in order: each row is
    its samples' tokens concatenated (one sample per row unless packed), then padding to `mb.seq`."""
    for r, row in enumerate(rows):
        pos = 0
        for i in row:
            n = len(samples[i]) - 1
            yield r, pos, n, i
            pos += n
        assert pos <= mb.seq, "a row is longer than its micro-batch's padded length"  # a plan bug


def micro_batch_tensors(samples: list[np.ndarray], mb: MicroBatch,
                        rows: tuple[tuple[int, ...], ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BT, labels_BT) of a micro-batch (or of its `rows`, a lockstep rank's part): each row is its samples'
    (input, label) pairs concatenated (one sample per row unless packed), right-padded to T with id 0 and label
    -100."""
    rows = mb.rows if rows is None else rows
    ids = np.zeros((len(rows), mb.seq), dtype=np.int64)
    labels = np.full((len(rows), mb.seq), IGNORE, dtype=np.int64)
    for r, pos, n, i in spans(samples, mb, rows):
        ids[r, pos:pos + n] = samples[i][:-1]
        labels[r, pos:pos + n] = samples[i][1:]
    return torch.from_numpy(ids), torch.from_numpy(labels)


def padded_rows(samples: list[np.ndarray], mb: MicroBatch, rows: tuple[tuple[int, ...], ...]) -> torch.Tensor | None:
    """The real tokens of each of `rows` (host int64 [B], the schemes' `ROW_TOKENS`), None when no row is padded."""
    n = [0] * len(rows)
    for r, _, tokens, _ in spans(samples, mb, rows):
        n[r] += tokens
    return padding.padded(torch.tensor(n, dtype=torch.int64), mb.seq)


class PlannedEngine(PipelineEngine):
    """The pipeline engine driven by a plan's instruction stream instead of a fixed schedule."""

    def run_plan(self, plan: MicroBatchPlan, replica: int, part: int, samples: list[np.ndarray], label_count: int,
                 device: torch.device) -> IterationResult:
        """Run `replica`'s micro-batches, of each its rows `part` of the plan's lockstep ranks (all rows when
        `plan.lockstep` is 1)."""
        rep = plan.replicas[replica]
        mbs = [plan.micro_batches[g] for g in rep.micro_batches]
        rows = [m.part(part, plan.lockstep) for m in mbs]
        # a micro-batch's auxiliary loss is that of all its rows (statistics summed over the lockstep ranks):
        # weighted by the whole micro-batch's share of the batch's tokens
        total = max(sum(m.tokens for m in plan.micro_batches), 1)
        chain, D, dtype = self.chain, self.stage.cfg.model.dim, self._act_dtype()
        result = IterationResult(loss_sum=0.0, aux_by_layer={}, busy_s=0.0)
        self._cpu0 = 0.0
        inputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        saved: dict[int, _Saved] = {}
        grad_in: dict[int, torch.Tensor] = {}
        recvs: dict[tuple[str, int], list[Any]] = {}
        sends: dict[tuple[str, int], list[Any]] = {}
        carries: dict[int, dict[str, torch.Tensor]] = {}  # a scheme's per-token state (early exit's active mask)
        pooled_in: dict[int, torch.Tensor] = {}  # moe.aux_loss_scope pooled: the running sums (`POOLED`) received
        totals_in: dict[int, torch.Tensor] = {}  # and the totals received back with the gradient
        totals_out: dict[int, torch.Tensor] = {}  # and those to send back with the input gradient
        names = self.scheme.carries
        self._last_backward = last_backward(rep.streams[chain.index])
        # a frozen prefix (`dynamism.scheme: freezing`) stops gradients at a boundary: a stage whose output needs
        # none skips its B ops and gradient receives, and its successor, whose input then needs none, skips its
        # gradient sends. Both sides read the same `frozen_prefix()`, so they agree without a message, as under
        # the fixed schedules (`PipelineEngine._backward`); the plan's other instructions run as planned.
        backward = self._output_needs_grad()
        with self.holding():  # parallel.accumulate whole, parallel.reshard step (a fully sharded stage)
            for op, j in rep.streams[chain.index]:
                mb = mbs[j]
                if op == "recv_act":  # the activation, then each carry (uint8), in the order the sender posts them
                    inputs[j] = torch.empty(len(rows[j]), mb.seq, D, dtype=dtype, device=device)
                    carries[j] = {n: torch.empty(len(rows[j]), mb.seq, dtype=torch.uint8, device=device)
                                  for n in names}
                    bufs = [inputs[j], *carries[j].values()]
                    if self.pooled:  # then the running sums of the pooled loss
                        pooled_in[j] = self.pooled_buffer(self.pooled_n, device)
                        bufs.append(pooled_in[j])
                    recvs[("act", j)] = [chain.post_recv(t, chain.prev) for t in bufs]
                elif op == "recv_grad":
                    if backward:
                        grads[j] = torch.empty_like(saved[j].out)
                        recvs[("grad", j)] = [chain.post_recv(grads[j], chain.next)]
                        if self.pooled:
                            totals_in[j] = self.pooled_buffer(self.counts_n, device)
                            recvs[("grad", j)].append(chain.post_recv(totals_in[j], chain.next))
                elif op in ("wait_act", "wait_grad"):
                    for handle in recvs.pop((op[5:], j), []):
                        chain.wait_recv(handle)
                elif op == "F":
                    ids, labels = (t.to(device) for t in micro_batch_tensors(samples, mb, rows[j]))
                    n_B = padded_rows(samples, mb, rows[j])
                    carry = ({n: t.bool() for n, t in carries.pop(j).items()} if j in carries else
                             self.scheme.init_carry(ids.shape[0], ids.shape[1], device, n_B))
                    if n_B is not None:  # every stage knows it from the plan: never sent
                        carry[ROW_TOKENS] = n_B
                    if j in pooled_in:
                        carry[POOLED] = pooled_in.pop(j)
                    saved[j] = self._forward_compute(j, ids, labels, label_count, mb.tokens / total, result,
                                                     inputs.pop(j, None), carry)
                    if not chain.is_last:  # as the stage's layers left them: what the next stage receives
                        carries[j] = {n: carry[n] for n in names}
                elif op == "B":
                    s = saved.pop(j)
                    if j in totals_in:
                        s.totals = totals_in.pop(j)
                    g = self._backward_compute(j, s, grads.pop(j, None), result) if backward else None
                    if g is not None:
                        grad_in[j] = g
                        if self.pooled:
                            totals_out[j] = self.counts_back(s)
                elif op == "send_act":
                    carry = carries.pop(j)  # the sends keep their uint8 copies until waited for
                    out = [saved[j].out, *(carry[n].to(torch.uint8) for n in names)]
                    totals = saved[j].totals  # the pooled loss's running sums (None without it)
                    if totals is not None:
                        out.append(totals)
                    sends[("act", j)] = [chain.post_send(t, chain.next) for t in out]
                elif op == "send_grad":
                    if j in grad_in:
                        sends[("grad", j)] = [chain.post_send(grad_in.pop(j), chain.prev)]
                        if j in totals_out:
                            sends[("grad", j)].append(chain.post_send(totals_out.pop(j), chain.prev))
                elif op.startswith("wait_send_"):
                    for handle in sends.pop((op[len("wait_send_"):], j), []):
                        chain.wait_send(handle)
                else:
                    raise ConfigError(f"unknown plan instruction {op!r}")
        assert not (recvs or sends or saved), "the instruction stream left transfers or activations behind"
        self._last_backward = None
        return result


@dataclass(frozen=True)
class Lockstep:
    """How the ranks of a stage share a plan: `replicas` independent pipelines (each its own micro-batches, by
    Karmarkar-Karp), each run by `ranks` ranks in lockstep (the same micro-batches in the same order, each rank
    its `MicroBatch.part` of every micro-batch's rows); this rank runs part `part` of replica `replica`."""

    replicas: int
    ranks: int
    replica: int
    part: int

    @classmethod
    def of(cls, dims: ParallelDims, cfg: Config) -> Lockstep:
        """Every rank of a stage when the MoE layers sum routing statistics over it at every micro-batch (the
        load-balancing or z-loss with more than one rank per stage), or when FSDP2 shards the stage over its
        ranks (`parallel.shard: full`: every micro-batch's forward and backward all-gather each unit's weights
        and reduce-scatter its gradients over the stage, so its ranks run the same micro-batches); else each
        expert-parallel group (its all-to-alls pair the shards' micro-batches); else every rank plans alone
        (DynaPipe's replicas)."""
        n = dims.size("dp_ep")
        if n > 1 and (planned_moe_losses(cfg) or cfg.parallel.shard == "full"):
            return cls(replicas=1, ranks=n, replica=0, part=dims.index("dp_ep"))
        return cls(replicas=dims.dp, ranks=dims.ep, replica=dims.index("dp"), part=dims.index("ep"))


class PlannedPipelineRunner(PipelineRunner):
    """The pipeline runner with planned micro-batches (pipeline.microbatching dynamic, padding or packing): the
    micro-batch planner (`balance/microbatches.py`) makes the plans, this runner executes them."""

    def __init__(self, cfg: Config, *, cost: MicroBatchCost | None = None, kwargs: dict[str, Any] | None = None,
                 workers: int | None = None, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.lockstep = Lockstep.of(self.dims, cfg)
        # aux_ranks: a stage's ranks that sum routing statistics run in lockstep, each adding 1/n of the loss
        self.engine = PlannedEngine(self.stage, self.chain, self.scheme, "1f1b", 1, self.engine.autocast,
                                    aux_ranks=self.data_ranks)
        self.engine.dilate = self.opts.dilate  # as the engine it replaces (no zero bubble here: no W reducer)
        ls = self.lockstep
        kwargs = kwargs or planner_kwargs(cfg, ls.replicas, ls.ranks)
        if kwargs.get("dp", 1) != ls.replicas or kwargs.get("lockstep", 1) != ls.ranks:
            raise ConfigError(f"micro-batch planner arguments plan {kwargs.get('dp', 1)} replica(s) of "
                              f"{kwargs.get('lockstep', 1)} lockstep rank(s); this pipeline runs {ls.replicas} of "
                              f"{ls.ranks}: pass planner_kwargs(cfg, {ls.replicas}, {ls.ranks})")
        self.microbatches = MicrobatchPlanner(self, cost=cost, kwargs=kwargs, workers=workers)
        self._last: dict[str, Any] = {}
        self._ran: tuple[MicroBatchPlan, list[np.ndarray]] | None = None  # the step's plan and samples

    def data_state(self) -> dict[str, Any]:
        """The data position of the next step to train (batches read ahead are read again on resume)."""
        return self.microbatches.data_state()

    def after_migration(self) -> None:
        if not self.released:  # a released rank has left the chain (and plans nothing)
            self.microbatches.after_migration()

    def state_dict(self) -> dict[str, Any]:
        """The runner's state, the scheme's stage scales of the batches read ahead and a measured cost table
        (`MicrobatchPlanner`)."""
        return {**super().state_dict(), "plan_scales": self.microbatches.plan_scales(),
                "plan_cost": self.microbatches.cost_state()}

    def load_state_dict(self, ranks: dict[str, dict[str, Any]], same_stages: bool = False) -> list[int] | None:
        sizes = super().load_state_dict(ranks, same_stages)
        first = self.job_state(ranks)
        if first.get("scheme_name") == self.scheme.name:  # another scheme's scales do not describe this one's costs
            self.microbatches.restore_scales(first.get("plan_scales", {}))
        self.microbatches.restore_cost(first.get("plan_cost"))
        return sizes

    # ---- the step ----
    def _next_input(self) -> tuple[Any, int]:
        plan, samples, count, self._last = self.microbatches.next(self.step + 1, self.lockstep.replica)
        return (plan, samples), count

    def _forward_tokens(self, work: Any) -> list[int]:
        """This rank's tokens in each of its replica's micro-batches, in the order of the stage's forwards."""
        plan, _ = work
        ls = self.lockstep
        rep = plan.replicas[ls.replica]
        order = [j for op, j in rep.streams[self.chain.index] if op == "F"]
        mbs = [plan.micro_batches[rep.micro_batches[j]] for j in order]
        return [len(m.part(ls.part, plan.lockstep)) * m.seq for m in mbs]

    def _run_engine(self, work: Any, count: int) -> IterationResult:
        plan, samples = work
        assert isinstance(self.engine, PlannedEngine)
        self._ran = work
        return self.engine.run_plan(plan, self.lockstep.replica, self.lockstep.part, samples, count, self.device)

    def _my_rows(self, j: int) -> tuple[MicroBatch, tuple[tuple[int, ...], ...]]:
        """Micro-batch j of this rank's replica (local index) and this rank's part of its rows."""
        assert self._ran is not None, "the step's plan before the step ran"
        plan, ls = self._ran[0], self.lockstep
        mb = plan.micro_batches[plan.replicas[ls.replica].micro_batches[j]]
        return mb, mb.part(ls.part, plan.lockstep)

    def _measure_rows(self, j: int, labels_BT: torch.Tensor) -> None:
        """After F(j): each sample of this rank's rows of micro-batch j, its share of two-expert tokens in the
        stage's MoE layers (a packed row holds several samples, a padded one padding: per sample, real tokens)."""
        assert self._ran is not None
        mb, rows = self._my_rows(j)
        seg = np.full((len(rows), mb.seq), -1, dtype=np.int64)
        slots = list(spans(self._ran[1], mb, rows))
        for k, (r, pos, n, _) in enumerate(slots):
            seg[r, pos:pos + n] = k
        self._complexity[j] = sample_complexity(self.stage.moe_layers(), upload(seg, self.device), len(slots))

    def _complexity_rows(self, sampler: Any) -> tuple[torch.Tensor, list[int], list[int], int]:
        """The batch's samples: each measured sample's position in the batch (the micro-batches measured in order,
        `_measure_rows`'), every sample's tokens, the ids and position the micro-batch planner read the batch with
        (`batch_ids`, `batch_at`)."""
        assert self._ran is not None
        samples = self._ran[1]
        index = torch.tensor([i for j in sorted(self._complexity) for *_, i in spans(samples, *self._my_rows(j))],
                             dtype=torch.int64)
        mb = self.microbatches
        return index, [len(x) - 1 for x in samples], mb.batch_ids, mb.batch_at

    def _routed_tokens(self) -> torch.Tensor | bool | None:
        """The real tokens (host bool [B x T]) of the micro-batch every stage forwarded last in this rank's
        replica, as its MoE layers' `last_routing` lays them out (None: no padding); False when the stages'
        last forwards differ (no sample then: every rank reads the same plan, so all skip it)."""
        assert self._ran is not None, "a routing sample before the step ran"
        plan, samples = self._ran
        last = {[j for op, j in stream if op == "F"][-1] for stream in plan.replicas[self.lockstep.replica].streams}
        if len(last) != 1:
            return False
        mb, rows = self._my_rows(last.pop())
        n_B = padded_rows(samples, mb, rows)
        return None if n_B is None else real_positions(n_B, mb.seq, torch.device("cpu")).reshape(-1)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        record = super().train_step()
        record.update(self._last)
        record["exposed_planning"] = round(self._last["plan_wait_s"] / max(time.perf_counter() - t0, 1e-9), 4)
        return record

    def close(self) -> None:
        self.microbatches.close()
        super().close()
