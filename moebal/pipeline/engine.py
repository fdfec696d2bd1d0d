"""The pipeline engine: one training iteration of one stage, micro-batch by micro-batch, over point-to-point.

Shape legend: B = rows of a micro-batch, T = sequence, D = model dim; M = micro-batches, L = decoder layers.

One iteration on stage p (`PipelineEngine.run`; `evaluate` runs only the F ops, for validation):
  1. split the (data-parallel shard of the) batch into M micro-batches along rows (sizes may differ by one);
  2. walk the stage's schedule (GPipe or 1F1B, `schedule.py`):
     F(j): receive h_j and the scheme's per-token carries from stage p - 1     <- blocking receive
           (the first stage embeds ids_j instead), run the stage's layers in ascending global order through
           the dynamism scheme, then send h_j to stage p + 1 (non-blocking; the last stage instead computes
           the summed token cross-entropy of micro-batch j and divides it by the batch's label count, so the
           micro-batch losses add up to the single-process mean loss);
     B(j): receive dL/dh_j from stage p + 1                                      <- blocking receive
           (the last stage starts from its loss), backpropagate through the stage together with its MoE
           layers' auxiliary losses scaled by 1/M (and by 1/n when the n ranks of a stage compute one
           auxiliary loss from their summed statistics: its gradient reaches every rank's own tokens through
           the differentiable all-reduce, and the gradient sync sums the n copies), and send dL/dh_in to
           stage p - 1 (non-blocking);
     W(j): (zero-bubble schedule only) the weight gradients of the stage's Linear layers for micro-batch j,
           which its B left for later (`zero_bubble.py` `WeightGradQueue`); local, no message;
  3. wait for every posted send (`chain.flush`).
A gradient crosses the boundary in front of stage p only when something before it trains: with a frozen
prefix of n layers, stages starting at layer <= n receive no gradient and their predecessors send none, on
every rank from the same `frozen_prefix()`, so both sides agree without a message.
Gradients accumulate in `.grad` across micro-batches; data-parallel sync, clipping and the optimizer step
are the runner's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moebal.dynamism.scheme import ROW_TOKENS, Dynamism
from moebal.models import noise, padding
from moebal.pipeline.observe import LayerProfiler
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage
from moebal.pipeline.units import ATTN, LAYER
from moebal.pipeline.zero_bubble import WeightGradQueue
from moebal.planner.schedule import make_schedule
from moebal.routing import pooled_balancing_loss
from moebal.sync import to_host

if TYPE_CHECKING:
    from moebal.distributed.fsdp import StepHold

__all__ = ["IterationResult", "PipelineEngine", "last_backward"]


@dataclass
class IterationResult:
    """What one stage reports about one iteration (numbers are local to the stage).

    The loss and auxiliary losses add up on the device as the micro-batches run (float64: the same additions in
    the same order as host floats, so the same bits) and are read to the host once, by `settle`: a host read per
    micro-batch and MoE layer would stall a GPU's queue inside the schedule."""

    loss_sum: float
    """Last stage: sum over micro-batches of (token CE sum / batch label count); 0 elsewhere (after `settle`)."""
    aux_by_layer: dict[int, float]
    """Each of this stage's MoE layers' auxiliary loss, averaged over micro-batches (after `settle`)."""
    busy_s: float
    """Wall time of this stage's compute (forward and backward ops, waits excluded)."""
    busy_cpu_s: float = 0.0
    """CPU time of the same ops (what the stage would take on a core of its own)."""
    w_cpu_s: float = 0.0
    """The part of `busy_cpu_s` spent in W ops (deferred weight gradients; zero-bubble schedule only)."""
    ops: list[tuple[str, int, float, float]] = field(default_factory=list)
    """(kind, micro-batch, start, end) per op, perf_counter clock (shared by local processes)."""
    loss_dev: torch.Tensor | None = None
    aux_dev: dict[int, torch.Tensor] = field(default_factory=dict)
    """The device sums behind `loss_sum` and `aux_by_layer` until `settle`."""

    def add_loss(self, loss: torch.Tensor) -> None:
        v = loss.detach().double()
        self.loss_dev = v if self.loss_dev is None else self.loss_dev + v

    def add_aux(self, i: int, aux: torch.Tensor, weight: float) -> None:
        v = aux.detach().double() * weight
        self.aux_dev[i] = v if i not in self.aux_dev else self.aux_dev[i] + v

    def settle(self, extra: torch.Tensor | None = None) -> list[float]:
        """Read the device sums into `loss_sum` and `aux_by_layer`, with `extra` (a 1-D float64 tensor on the
        same device, e.g. the step's gradient squares) in the same host read; returns `extra`'s values."""
        ids, loss = sorted(self.aux_dev), self.loss_dev
        parts = [self.aux_dev[i].reshape(1) for i in ids] + ([loss.reshape(1)] if loss is not None else [])
        n = len(parts)
        if extra is not None:
            parts.append(extra.reshape(-1).double())
        if not parts:
            return []
        vals: list[float] = to_host(torch.cat(parts), "pipeline step sums")
        for i, v in zip(ids, vals):
            self.aux_by_layer[i] = self.aux_by_layer.get(i, 0.0) + v
        if loss is not None:
            self.loss_sum += vals[len(ids)]
        self.loss_dev, self.aux_dev = None, {}
        return vals[n:]


POOLED = "pooled_sums"
"""The carry key of `moe.aux_loss_scope: pooled`'s running sums: fp32 [1 + 2E] (tokens, counts, probability sums,
detached) of every MoE layer up to this stage's, sent on with the activation; the last stage's are the
micro-batch's totals, of which (tokens, counts) travel back with the gradient (`PipelineEngine` "Pooled")."""


@dataclass
class _Saved:
    h_in: torch.Tensor | None
    out: torch.Tensor
    aux: list[torch.Tensor]
    marks: dict[int, float]
    pooled: torch.Tensor | None = None
    """Pooled scope: this stage's MoE layers' `balance_sums` summed, carrying their gradient (None otherwise)."""
    totals: torch.Tensor | None = None
    """Pooled scope: the micro-batch's running sums after this stage (the totals on the last stage; detached)."""
    aux_w: float = 0.0
    """The micro-batch's auxiliary-loss weight (its share of the batch)."""


class PipelineEngine:
    """Runs one stage's share of an iteration; the stage, chain and scheme may change between iterations.

    Pooled: under `moe.aux_loss_scope: pooled` the balancing loss of a micro-batch is one loss over every MoE
    layer of every stage, E * sum_e (C_e / N) (P_e / N) with C, P and N summed over the layers
    (`pooled_balancing_loss`). Given the totals C and N (constants: no gradient flows through counts) it is linear
    in each layer's probability sums, so each stage's backward adds its own layers' part, coef * E * sum_e C_e P_e /
    N^2 (the parts add up to the loss), once it knows the totals: the forward sends the running sums on beside the
    activation (`POOLED`), and the backward sends the last stage's (N, C) back beside the input gradient, along
    exactly the boundaries gradients cross (a stage whose output needs no gradient needs no totals). The last
    stage logs the whole loss (under the last layer's slot: the per-layer slots are only summed)."""

    def __init__(self, stage: PipelineStage, chain: PipeChain, scheme: Dynamism | None = None,
                 schedule: str = "1f1b", num_micro: int = 1, autocast: Any = None, aux_ranks: int = 1) -> None:
        self.stage, self.chain = stage, chain
        self.aux_ranks = aux_ranks
        self.scheme = scheme or Dynamism()
        self.schedule_name, self.num_micro = schedule, num_micro
        self.autocast = autocast or nullcontext
        self._wire = next(stage.parameters()).dtype
        """The dtype activations and their gradients cross stages in: the parameters' as built (fp32 masters).
        Fixed here, on every stage alike: a parameter's dtype read later can be the compute dtype FSDP2 holds a
        unit in while it is gathered (`parallel.param_dtype: bf16`), and the layers' output dtype depends on the
        sharding policy, so a stage's sends are cast to it (`_forward_compute`) and every receive allocates it."""
        make_schedule(schedule, chain.size, chain.index, num_micro)  # validates the names and sizes
        moe = stage.cfg.moe
        self.pooled = moe.aux_loss_scope == "pooled" and moe.num_experts > 0 and moe.aux_loss_coef > 0
        """Whether the stages exchange `POOLED` sums (see the class docstring)."""
        self.pooled_n, self.counts_n = 1 + 2 * moe.num_experts, 1 + moe.num_experts
        """The running sums' length (tokens, counts, probability sums), and the (tokens, counts) totals' sent
        back."""
        self.wgrad = WeightGradQueue()
        self.profiler: LayerProfiler | None = None
        self.record_ops = False
        self.dilate = 1.0
        """> 1: emulate devices this many times slower than a core (`pipeline.dilate`)."""
        self.last_pass: Callable[[bool], None] | None = None
        """Called with True just before the forward of the micro-batch whose backward is this stage's last of the
        step, with False just after it. Pro-Prophet's block overlap arms Agg's hooks for that forward (a forward
        captures them for its own backward), so each MoE layer's replica gradients leave inside the step's last
        backward, with what the earlier backward passes left in `.grad` (`StageExperts.last_pass`,
        `ExpertParallel.arm_agg`). Every micro-batch's backward follows its forward, so the last backward follows
        every forward and every other backward."""
        self._last_backward: int | None = None  # the micro-batch of that backward while a step runs
        self.step_hold: StepHold | None = None
        """A fully sharded stage's `parallel.accumulate: whole` and `parallel.reshard: step` (moebal/distributed/
        fsdp.py `StepHold`): begun as a step's schedule starts, switched for the last backward as that backward
        starts (`_backward_compute`), so each unit's gradients add up whole over the micro-batches and that
        backward reduce-scatters the sums once (and its weights, kept gathered since the step's first forward,
        are freed after it); ended when the schedule ends, whatever happened. Under whole sums zero bubble's W
        ops keep their deferred weight gradients for the step's last W (`_weight_grads`)."""
        self._last_weight: int | None = None  # the micro-batch of the stage's last W op while a step runs
        self.on_forward: Callable[[int, torch.Tensor], None] | None = None
        """Called after the stage's layers ran micro-batch j of a training step, with j and the micro-batch's
        labels (the runner measures the curriculum's row complexities from the layers' `last_routing`)."""

    # ---- boundaries of the frozen prefix (layers [0, n) frozen) ----
    def _input_needs_grad(self) -> bool:
        """The previous stage trains its last unit's layer: it needs this stage's input gradient."""
        if self.chain.is_first:
            return False
        units = self.stage.units
        return self.scheme.frozen_prefix() <= units.layer(self.stage.unit_ids[0] - 1)

    def _output_needs_grad(self) -> bool:
        units = self.stage.units
        return self.chain.is_last or self.scheme.frozen_prefix() <= units.layer(self.stage.unit_ids[-1])

    # ---- one iteration ----
    def run(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor, label_count: int,
            micro_rows: list[int] | None = None, row_tokens: torch.Tensor | None = None) -> IterationResult:
        """Forward and backward of every micro-batch of this rank's rows; gradients accumulate.

        `micro_rows`: this rank's rows in each micro-batch, in order (every rank of a stage has the same count
        of micro-batches); default: the rows cut into `num_micro` near-equal parts. `row_tokens`: each row's real
        tokens (host int64 [B]; right padding follows them), None when no row is padded."""
        if micro_rows is None:
            M = min(self.num_micro, ids_BT.shape[0])
            ids, labels = torch.tensor_split(ids_BT, M), torch.tensor_split(labels_BT, M)
            tokens = torch.tensor_split(row_tokens, M) if row_tokens is not None else None
        else:
            M = len(micro_rows)
            ids, labels = torch.split(ids_BT, micro_rows), torch.split(labels_BT, micro_rows)
            tokens = torch.split(row_tokens, micro_rows) if row_tokens is not None else None
        saved: dict[int, _Saved] = {}
        result = IterationResult(loss_sum=0.0, aux_by_layer={}, busy_s=0.0)
        self._cpu0 = 0.0
        ops = make_schedule(self.schedule_name, self.chain.size, self.chain.index, M)
        self._last_backward = last_backward(ops)
        self._last_weight = last_backward(ops, "W")
        split = self._last_weight is not None
        self.wgrad.clear()
        with self.wgrad.installed(self.stage) if split else nullcontext(), self.holding():
            for kind, j in ops:
                if kind == "F":
                    with self.wgrad.capture(j) if split else nullcontext():
                        saved[j] = self._forward(j, ids[j], labels[j], label_count, M, result,
                                                 _padded(tokens, j, ids[j].shape[1]))
                elif kind == "B":
                    # a recomputed layer's Linears run again in B: deferred like F's (their closures are F's)
                    with self.wgrad.capture(j) if split else nullcontext():
                        self._backward(j, saved.pop(j), M, result)
                else:
                    self._weight_grads(j, result)
        assert self.wgrad.pending() == 0, "a deferred weight gradient was never run"
        self.chain.flush()
        self._last_backward = self._last_weight = None
        return result

    def holding(self) -> AbstractContextManager[Any]:
        """A step's passes under `step_hold`, ended on the way out."""
        return self.step_hold.step() if self.step_hold is not None else nullcontext()

    @torch.no_grad()
    def evaluate(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor, micro_rows: list[int],
                 row_tokens: torch.Tensor | None = None) -> float:
        """Forward only, for validation: F(j) of every micro-batch of this rank's rows in order (receive, the
        stage's layers through the scheme, send; no backward, hence no schedule to follow). Returns the summed
        token cross-entropy of the rows on the last stage, 0 elsewhere. No gradient, profile or op record.
        `row_tokens` as `run`'s."""
        ids, labels = torch.split(ids_BT, micro_rows), torch.split(labels_BT, micro_rows)
        tokens = torch.split(row_tokens, micro_rows) if row_tokens is not None else None
        result = IterationResult(loss_sum=0.0, aux_by_layer={}, busy_s=0.0)
        profiler, record_ops = self.profiler, self.record_ops
        self.profiler, self.record_ops = None, False
        try:
            for j in range(len(micro_rows)):
                # label count 1: sums
                self._forward(j, ids[j], labels[j], 1, len(micro_rows), result, _padded(tokens, j, ids[j].shape[1]))
        finally:
            self.profiler, self.record_ops = profiler, record_ops
        self.chain.flush()
        result.settle()
        return result.loss_sum

    def _receive_input(self, ids_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, T = ids_BT.shape
        D = self.stage.cfg.model.dim
        h = torch.empty(B, T, D, dtype=self._act_dtype(), device=ids_BT.device)
        self.chain.recv(h, self.chain.prev)
        carry = {}
        for name in self.scheme.carries:
            buf = torch.empty(B, T, dtype=torch.uint8, device=ids_BT.device)
            carry[name] = self.chain.recv(buf, self.chain.prev).bool()
        if self.pooled:
            carry[POOLED] = self.chain.recv(self.pooled_buffer(self.pooled_n, ids_BT.device), self.chain.prev)
        return h, carry

    @staticmethod
    def pooled_buffer(n: int, device: torch.device) -> torch.Tensor:
        """A receive buffer of `n` pooled sums (fp32)."""
        return torch.empty(n, dtype=torch.float32, device=device)

    def _act_dtype(self) -> torch.dtype:
        return self._wire

    def _forward(self, j: int, ids_BT: torch.Tensor, labels_BT: torch.Tensor, label_count: int, M: int,
                 result: IterationResult, n_B: torch.Tensor | None = None) -> _Saved:
        h_in: torch.Tensor | None = None
        if self.chain.is_first:
            carry = self.scheme.init_carry(ids_BT.shape[0], ids_BT.shape[1], ids_BT.device, n_B)
        else:
            h_in, carry = self._receive_input(ids_BT)
        if n_B is not None:  # every stage knows it from its own rows of the batch: never sent
            carry[ROW_TOKENS] = n_B
        s = self._forward_compute(j, ids_BT, labels_BT, label_count, 1.0 / M, result, h_in, carry)
        if not self.chain.is_last:
            self.chain.send(s.out, self.chain.next)
            for name in self.scheme.carries:
                self.chain.send(carry[name].to(torch.uint8), self.chain.next)
            if s.totals is not None:
                self.chain.send(s.totals, self.chain.next)
        return s

    def _forward_compute(self, j: int, ids_BT: torch.Tensor, labels_BT: torch.Tensor, label_count: int,
                         aux_w: float, result: IterationResult, h_in: torch.Tensor | None,
                         carry: dict[str, torch.Tensor]) -> _Saved:
        """F(j) on this stage from its input (ids on the first stage, the received h_in elsewhere); the MoE
        auxiliary losses enter the backward weighted by aux_w. Sends nothing."""
        last = self.last_pass if j == self._last_backward else None
        if last is not None:
            last(True)
        try:
            # router noise keyed by micro-batch (moebal/models/noise.py), the MoE losses without its padding
            # (moebal/models/padding.py)
            with noise.micro_batch_key(j), padding.rows(carry.get(ROW_TOKENS), ids_BT.shape[1]):
                return self._forward_pass(j, ids_BT, labels_BT, label_count, aux_w, result, h_in, carry)
        finally:
            if last is not None:
                last(False)

    def _forward_pass(self, j: int, ids_BT: torch.Tensor, labels_BT: torch.Tensor, label_count: int,
                      aux_w: float, result: IterationResult, h_in: torch.Tensor | None,
                      carry: dict[str, torch.Tensor]) -> _Saved:
        st, prof = self.stage, self.profiler
        if h_in is not None:
            h_in.requires_grad_(self._input_needs_grad())
        t0 = time.perf_counter()
        self._cpu0 = time.thread_time()
        marks: dict[int, float] = {}
        frozen = self.scheme.frozen_prefix()
        self.scheme.aux_weight = aux_w / self.aux_ranks  # a scheme's own auxiliary loss, weighted as the MoE ones
        with self.autocast():
            if self.chain.is_first:
                self.wgrad.slot = st.num_layers_slot()
                with _maybe(prof, st.num_layers_slot(), st.model.embed_tokens), _grad(frozen == 0):
                    h = st.embed(ids_BT)
            else:
                assert h_in is not None  # every stage but the first computes from the activation it received
                h = h_in
            cos, sin = st.rope(ids_BT.shape[1], h.dtype)
            aux: list[torch.Tensor] = []
            sums: list[torch.Tensor] = []
            for u in st.unit_ids:
                i, kind = st.units.parts[u]
                _mark(h, prof, marks, u)
                self.wgrad.slot = u
                layer = st.layer(i)
                with _maybe(prof, u, st.unit_module(u) if prof is not None else None), _grad(i >= frozen):
                    if kind == LAYER:
                        h = self.scheme.layer_forward(i, layer, h, cos, sin, carry)
                    elif kind == ATTN:  # half of a split layer: the scheme runs its attention half
                        h = self.scheme.attention_half(i, layer, h, cos, sin)
                    else:
                        h = layer.ffn_part(h)
                if kind == LAYER and layer.is_moe:
                    a = layer.block_sparse_moe.aux_loss
                    result.add_aux(i, a, aux_w)  # on the device: no host read inside the schedule
                    if a.requires_grad:
                        aux.append(a.float() * aux_w / self.aux_ranks)
                    if layer.block_sparse_moe.balance_sums is not None:  # taken: never read by a later pass
                        sums.append(layer.block_sparse_moe.balance_sums)
                        layer.block_sparse_moe.balance_sums = None
            if self.on_forward is not None:
                self.on_forward(j, labels_BT)  # the stage's layers have run micro-batch j (their `last_routing`)
            if self.chain.is_last:
                _mark(h, prof, marks, st.num_layers_slot() + 1)
                self.wgrad.slot = st.num_layers_slot() + 1
                with _maybe(prof, st.num_layers_slot() + 1, None):
                    out = st.head_loss_sum(h, labels_BT) / label_count
                result.add_loss(out)
            else:
                out = h.to(self._wire)  # what the next stage allocates (a no-op in the usual fp32 stream)
        saved = _Saved(h_in, out, aux, marks, aux_w=aux_w)
        if self.pooled:
            self._pool(saved, sums, carry, result)
        self._op_done(result, "F", j, t0)
        return saved

    def _pool(self, s: _Saved, sums: list[torch.Tensor], carry: dict[str, torch.Tensor],
              result: IterationResult) -> None:
        """Pooled scope, after F: this stage's layers' sums (with their gradient) into `s.pooled`, the running
        sums after this stage (what the next stage receives) into `s.totals`; on the last stage the whole loss
        logged."""
        running = carry.get(POOLED)
        for part in sums:  # layer by layer, as `pooled_balancing_loss` adds them: the same bits on any partition
            running = part.detach() if running is None else running + part.detach()
        s.totals = torch.zeros(self.pooled_n, dtype=torch.float32, device=s.out.device) if running is None \
            else running
        local = torch.stack(sums).sum(dim=0) if sums else None  # its gradient: the same for each layer's sums
        s.pooled = local if local is not None and local.requires_grad else None
        if self.chain.is_last:
            loss = self.stage.cfg.moe.aux_loss_coef * pooled_balancing_loss([s.totals])
            result.add_aux(self.stage.cfg.model.n_layers - 1, loss, s.aux_w)

    def _backward(self, j: int, s: _Saved, M: int, result: IterationResult) -> None:
        if not self._output_needs_grad():
            return  # a fully frozen stage (and no trainable stage before it): nothing to differentiate
        if self.chain.is_last:
            grad = None
        else:
            grad = self.chain.recv(torch.empty_like(s.out), self.chain.next)
            if self.pooled:  # the micro-batch's (tokens, counts), from the last stage
                s.totals = self.chain.recv(self.pooled_buffer(self.counts_n, grad.device), self.chain.next)
        g_in = self._backward_compute(j, s, grad, result)
        if g_in is not None:
            self.chain.send(g_in, self.chain.prev)
            if self.pooled:
                self.chain.send(self.counts_back(s), self.chain.prev)

    def counts_back(self, s: _Saved) -> torch.Tensor:
        """Pooled scope: the (tokens, counts) totals to send to the previous stage with the input gradient."""
        assert s.totals is not None
        return s.totals[:self.counts_n]

    def _backward_compute(self, j: int, s: _Saved, grad: torch.Tensor | None,
                          result: IterationResult) -> torch.Tensor | None:
        """B(j) on this stage from the output gradient (None on the last stage: from its loss); returns the
        gradient of the stage's input when the previous stage needs it. Sends nothing."""
        if self.step_hold is not None and j == self._last_backward:
            self.step_hold.last_backward()  # the step's last backward reduce-scatters the whole sums
        t0 = time.perf_counter()
        self._cpu0 = time.thread_time()
        clock = self.profiler.clock if self.profiler is not None else time.perf_counter
        c0 = clock()
        if s.pooled is not None:  # this stage's part of the pooled loss, from the totals (class docstring)
            assert s.totals is not None, "the pooled loss's totals never arrived"
            E = self.stage.cfg.moe.num_experts
            tokens = s.totals[0].clamp(min=1.0)
            part = (s.totals[1:1 + E] * s.pooled[1 + E:]).sum() * (E / (tokens * tokens))
            s.aux.append(part * (self.stage.cfg.moe.aux_loss_coef * s.aux_w / self.aux_ranks))
            s.pooled = None
        tensors = [s.out] + s.aux
        grads = [grad] + [None] * len(s.aux) if grad is not None else None
        if s.out.requires_grad or s.aux:
            if grad is None:
                tensors = [sum(tensors[1:], tensors[0])]
            torch.autograd.backward(tensors, grads)
        c1 = clock()
        if self.profiler is not None:
            self.profiler.backward_marks(self._slots(), s.marks, c0, c1)
        self._op_done(result, "B", j, t0)
        if self._input_needs_grad():
            assert s.h_in is not None and s.h_in.grad is not None, "stage input received no gradient"
            return s.h_in.grad
        return None

    def _weight_grads(self, j: int, result: IterationResult) -> None:
        """W(j): the deferred Linear weight gradients of micro-batch j, timed per cost slot when profiling. With a
        reducer (fully sharded stages) the closures run slot by slot in descending slot order (stable: a slot's
        own in backward order, so each parameter's sum is the same) and each slot's whole gradients are
        reduce-scattered as the slot ends: one slot's whole at a time, in the same order on every rank."""
        t0 = time.perf_counter()
        self._cpu0 = time.thread_time()
        prof = self.profiler
        items = self.wgrad.pop(j)
        if self.wgrad.reducer is not None:
            items = sorted(items, key=lambda item: -item[0])
        for k, (slot, fn) in enumerate(items):
            c0 = prof.clock() if prof is not None else 0.0
            fn()
            if (k + 1 == len(items) or items[k + 1][0] != slot) and (
                    self.step_hold is None or not self.step_hold.whole_sums or j == self._last_weight):
                # a sharded stage: the slot's reduce-scatter (collective over the stage); under whole sums the
                # last W's first one sends every slot's sums of the earlier W ops too
                self.wgrad.flush()
            if prof is not None:
                prof.add_weight_grad(slot, j, prof.clock() - c0)
        self._op_done(result, "W", j, t0)

    def _slots(self) -> list[int]:
        L = self.stage.num_layers_slot()
        return ([L] if self.chain.is_first else []) + self.stage.unit_ids + ([L + 1] if self.chain.is_last else [])

    def owned_slots(self) -> list[int]:
        return self._slots()

    def _op_done(self, result: IterationResult, kind: str, j: int, t0: float) -> None:
        cpu = time.thread_time() - self._cpu0
        if self.dilate > 1.0:  # a device `dilate` times slower than this core: the op ends at dilate x its CPU time
            rest = self.dilate * cpu - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)  # before the op's output is sent, as a slower device would send it
        t1 = time.perf_counter()
        result.busy_s += t1 - t0
        result.busy_cpu_s += cpu
        if kind == "W":
            result.w_cpu_s += cpu
        if self.record_ops:
            result.ops.append((kind, j, t0, t1))


def _padded(tokens: tuple[torch.Tensor, ...] | None, j: int, T: int) -> torch.Tensor | None:
    """Micro-batch j's rows' real tokens (the schemes' `ROW_TOKENS`), None when none of its rows is padded."""
    return None if tokens is None else padding.padded(tokens[j], T)


def last_backward(ops: Iterable[tuple[str, int]], kind: str = "B") -> int | None:
    """The micro-batch of a stage's last backward (B) op in a schedule or instruction stream, or of its last op of
    another `kind` (W: weight gradients); None: none."""
    bs = [j for k, j in ops if k == kind]
    return bs[-1] if bs else None


def _grad(enabled: bool) -> Any:
    return nullcontext() if enabled else torch.no_grad()


def _maybe(prof: LayerProfiler | None, slot: int, module: Any) -> Any:
    return prof.forward(slot, module) if prof is not None else nullcontext()


def _mark(h: torch.Tensor, prof: LayerProfiler | None, marks: dict[int, float], slot: int) -> None:
    """On profiled iterations, note when the gradient of `h` (the input of `slot`) is complete."""
    if prof is not None and h.requires_grad:
        clock = prof.clock
        h.register_hook(lambda g: marks.__setitem__(slot, clock()))
