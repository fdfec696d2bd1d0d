"""Observe: per-layer forward/backward time and activation memory, measured on profiled iterations only.

Shape legend: L = decoder layers; a cost vector has L + 2 slots: the layers, then the embedding (first
stage) and the head (final norm, LM head and loss, last stage).

Cost definition (the papers leave it open; DynMo's code times the forward only): a layer's cost is its
forward plus backward time for one micro-batch, the median over the profiled iteration's micro-batches
(robust to one slow micro-batch on a shared machine), smoothed across profiled iterations by an EMA.
Backward time comes from gradient hooks on the tensors between layers: layer i's backward runs from the
moment the gradient of its output is complete to the moment the gradient of its input is. A frozen layer
has no backward, so its measured cost is its forward alone (DynMo's cost model says 0, which is wrong: the
forward still runs). Under the zero-bubble schedule a layer's deferred weight gradients (its W share) are
timed when W runs and added to that micro-batch's backward, so a cost means the same on every schedule.
Communication is not part of a layer's cost.

Clock: on a CPU, a layer's cost is the CPU time of the rank's thread (`time.thread_time`, one intra-op thread;
`process_time` with more), not wall time: when more ranks share the machine than it has cores, wall time
measures the scheduler (an idle stage lends its core, a busy one waits for it), which made time-based plans
worse than static ones on the 2-core machine moebal is developed on. On CUDA, wall time after a device
synchronise (profiled iterations only). CPU time is stable but not in the unit of the transfers and
migrations (wall seconds); the planner converts with the profiled iteration's contention factor
kappa = sum of stages' wall busy time / sum of their CPU time, so it compares gains and costs in one unit.

Memory per layer: parameter, gradient and optimizer bytes (counted) plus the bytes autograd saves for the
backward during the layer's forward (measured with saved-tensor hooks, parameters excluded), times the
micro-batches the schedule keeps in flight on its stage. No device statistics are needed, so it is the same
on CPU and GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

MIN_FACTOR = 1e-3
"""Smallest cost factor a prediction may scale a layer by (a layer never costs nothing: its forward runs)."""

__all__ = ["CostTracker", "IterationProfile", "LayerProfiler", "held_bytes", "pick_clock", "static_bytes",
           "transfer_bytes"]


def pick_clock(device: torch.device) -> Callable[[], float]:
    """The clock layer costs are measured with (see the module docstring); chosen once per engine."""
    if device.type == "cuda":
        def cuda_clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return cuda_clock
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


@dataclass
class IterationProfile:
    """Medians over one profiled iteration's micro-batches; -1 marks a slot this rank does not own."""

    fwd: np.ndarray
    bwd: np.ndarray
    act_bytes: np.ndarray
    wgt: np.ndarray
    """The part of `bwd` that ran as deferred weight gradients (W ops; zero outside the zero-bubble schedule)."""


class LayerProfiler:
    """Collects timings for one iteration; the engine calls it only when profiling is on."""

    def __init__(self, num_layers: int, clock: Callable[[], float] = time.perf_counter,
                 count_bytes: bool = True) -> None:
        self.L, self.clock, self.count_bytes = num_layers, clock, count_bytes
        self.fwd: dict[int, list[float]] = {}
        self.bwd: dict[int, list[float]] = {}
        self.act: dict[int, list[float]] = {}
        self.wgt: dict[tuple[int, int], float] = {}
        """(slot, micro-batch) -> deferred weight-gradient time (zero-bubble W ops), added to that backward."""
        self._saved = 0
        self._param_ptrs: set[int] = set()

    # slots: 0..L-1 layers, L embedding, L+1 head
    def add(self, table: dict[int, list[float]], slot: int, value: float) -> None:
        table.setdefault(slot, []).append(value)

    @contextmanager
    def forward(self, slot: int, module: nn.Module | None) -> Iterator[None]:
        """Time a forward piece and count the activation bytes it saves for backward."""
        self._param_ptrs = {p.data_ptr() for p in module.parameters()} if module is not None else set()
        self._saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in self._param_ptrs:
                self._saved += t.numel() * t.element_size()
            return t

        t0 = self.clock()
        if self.count_bytes:  # a Python call per saved tensor: only when memory caps need the number
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        else:
            yield
        self.add(self.fwd, slot, self.clock() - t0)
        self.add(self.act, slot, float(self._saved))

    def backward_marks(self, slots_out: list[int], marks: dict[int, float], t_start: float, t_end: float) -> None:
        """Backward times from boundary marks: `marks[i]` is when the gradient of layer i's input was complete.

        `slots_out` are this stage's layer slots in order; the head (if any) runs first, the embedding last.
        """
        prev = t_start
        for slot in reversed(slots_out):  # backward visits layers from the last to the first
            end = marks.get(slot)
            if end is None:  # input needed no gradient (a frozen prefix ends here): the rest of the time
                end = t_end
            self.add(self.bwd, slot, max(end - prev, 0.0))
            prev = end

    def add_weight_grad(self, slot: int, micro_batch: int, seconds: float) -> None:
        key = (slot, micro_batch)
        self.wgt[key] = self.wgt.get(key, 0.0) + seconds

    def result(self, owned: list[int]) -> IterationProfile:
        fwd = np.full(self.L + 2, -1.0)
        bwd = np.full(self.L + 2, -1.0)
        act = np.full(self.L + 2, -1.0)
        wgt = np.full(self.L + 2, -1.0)
        for slot in owned:
            fwd[slot] = float(np.median(self.fwd.get(slot, [0.0])))
            # B(j) runs in micro-batch order on every schedule: entry j of a slot's list is micro-batch j
            back = [b + self.wgt.get((slot, j), 0.0) for j, b in enumerate(self.bwd.get(slot, [0.0]))]
            bwd[slot] = float(np.median(back))
            act[slot] = float(np.median(self.act.get(slot, [0.0])))
            wgt[slot] = float(np.median([self.wgt.get((slot, j), 0.0) for j in range(max(len(back), 1))]))
        return IterationProfile(fwd, bwd, act, wgt)


def static_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """Weight + gradient + optimizer-state + buffer bytes of a module on this rank (`held_bytes`)."""
    return float(sum(held_bytes(module, optimizer).values()))


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """What this rank holds of a module between steps, by kind, as the layer balancer's memory estimate counts
    it. Weights: as kept at rest, a sharded optimizer saying how (`param_weight_bytes`: FSDP2's shards,
    expert weights sharded at rest, fp32 masters beside bf16 compute copies), else the local tensor (a DTensor's
    shard). Gradients: one local tensor per trainable parameter in its dtype, whether or not it exists now (it
    will in the next backward; at rest expert gradients are whole until their reduce-scatter after the
    backward). Optimizer state: this rank's share (`_state_bytes`)."""
    out = {"weights": 0, "grads": 0, "optimizer": 0, "buffers": 0}
    per_param = getattr(optimizer, "param_weight_bytes", None)
    for p in module.parameters():
        local = _local_numel(p) * p.element_size()
        w = per_param(p) if per_param is not None else None
        out["weights"] += local if w is None else int(w)
        out["grads"] += local if p.requires_grad else 0
        out["optimizer"] += _state_bytes(optimizer, p, whole=False)
    out["buffers"] = sum(_local_numel(b) * b.element_size() for b in module.buffers())
    return out


def _local_numel(t: torch.Tensor) -> int:
    to_local = getattr(t, "to_local", None)  # a DTensor: its shard on this rank
    return int(to_local().numel()) if to_local is not None else t.numel()


def transfer_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    """What migrating the module sends between iterations: its state (parameters, buffers), its optimizer state
    and any gradient that exists now (none after the optimizer step)."""
    total = 0
    for t in module.state_dict().values():
        total += t.numel() * t.element_size()
    for p in module.parameters():
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
        total += _state_bytes(optimizer, p, whole=True)
    return float(total)


def _state_bytes(optimizer: torch.optim.Optimizer | None, p: torch.Tensor, whole: bool) -> int:
    """Optimizer-state bytes of parameter `p` on this rank, or (`whole`) all of it: a sharded optimizer
    (`param_state_bytes`, moebal/distributed/sharded.py) keeps a share and a migration moves it whole."""
    if optimizer is None:
        return 0
    per_param = getattr(optimizer, "param_state_bytes", None)
    if per_param is not None:
        return int(per_param(p, whole))
    return sum(v.numel() * v.element_size() for v in optimizer.state.get(p, {}).values()
               if isinstance(v, torch.Tensor))


@dataclass
class CostTracker:
    """Smoothed per-slot costs, identical on every rank (updated from all-reduced profiles only).

    A layer's measured time is divided by the cost factor its dynamism scheme predicted for the profiled
    iteration before smoothing, so the tracker holds each layer's cost without dynamism ("at factor 1"), and
    `layer_costs(factors)` scales it by the latest prediction: profiles taken before and after the dynamism
    moved (a layer froze, the routing shifted) average correctly, and between profiles the plan follows the
    scheme's per-iteration prediction (MoE routing moves every iteration; profiling every one would cost).
    """

    num_layers: int
    ema: float = 0.5
    """Weight of the newest profile (1 keeps only the latest)."""
    fwd: np.ndarray = field(init=False)
    bwd: np.ndarray = field(init=False)
    act_bytes: np.ndarray = field(init=False)
    wgt: np.ndarray = field(init=False)
    """The part of `bwd` measured as deferred weight gradients (zero-bubble W ops; zeros otherwise)."""
    samples: int = 0

    def __post_init__(self) -> None:
        n = self.num_layers + 2
        self.fwd, self.bwd, self.act_bytes, self.wgt = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)

    def update(self, fwd: np.ndarray, bwd: np.ndarray, act_bytes: np.ndarray,
               factors: np.ndarray | None = None, wgt: np.ndarray | None = None) -> None:
        wgt = np.zeros(self.num_layers + 2) if wgt is None else wgt
        if factors is not None:
            f = np.ones(self.num_layers + 2)
            f[:self.num_layers] = np.maximum(np.asarray(factors, dtype=np.float64), MIN_FACTOR)
            fwd, bwd, wgt = fwd / f, bwd / f, wgt / f
        a = 1.0 if self.samples == 0 else self.ema
        self.fwd = (1 - a) * self.fwd + a * fwd
        self.bwd = (1 - a) * self.bwd + a * bwd
        self.wgt = (1 - a) * self.wgt + a * wgt
        self.act_bytes = np.maximum(act_bytes, (1 - a) * self.act_bytes + a * act_bytes)
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples > 0

    def layer_costs(self, factors: np.ndarray | None = None) -> np.ndarray:
        L = self.num_layers
        costs: np.ndarray = self.fwd[:L] + self.bwd[:L]
        if factors is not None:
            costs = costs * np.maximum(np.asarray(factors, dtype=np.float64), MIN_FACTOR)
        return costs

    @property
    def first_extra(self) -> float:
        return float(self.fwd[self.num_layers] + self.bwd[self.num_layers])

    @property
    def last_extra(self) -> float:
        return float(self.fwd[self.num_layers + 1] + self.bwd[self.num_layers + 1])

    def state_dict(self) -> dict[str, object]:
        return {"fwd": self.fwd.tolist(), "bwd": self.bwd.tolist(), "act": self.act_bytes.tolist(),
                "wgt": self.wgt.tolist(), "samples": self.samples}

    def load_state_dict(self, s: Mapping[str, Any]) -> None:
        self.fwd = np.asarray(s["fwd"], dtype=np.float64)
        self.bwd = np.asarray(s["bwd"], dtype=np.float64)
        self.act_bytes = np.asarray(s["act"], dtype=np.float64)
        # checkpoints written before the zero-bubble schedule carry no W times
        self.wgt = np.asarray(s.get("wgt", np.zeros_like(self.bwd)), dtype=np.float64)
        self.samples = int(s["samples"])
