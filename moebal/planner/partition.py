"""Stage partitioners: pure functions from per-layer costs to layers-per-stage.

Shape legend: L = layers, P = stages.

A partition is a list `sizes` of P positive layer counts; stage p runs layers
[sum(sizes[:p]), sum(sizes[:p+1])). Layers stay contiguous and in model order, always: DynMo's Algorithm 3
sends a layer to the least-loaded stage wherever it sits, which re-orders the network's blocks and changes
the model; moebal's diffusion only moves a boundary layer between adjacent stages (the extraction's
option (a)), and the exact partitioner only produces contiguous ranges.

The embedding is pinned to the first stage and the head (final norm, LM head, loss) to the last; their
time and memory count toward those stages through `first_extra`/`last_extra`, so a stage holding them
gets fewer layers instead of being overloaded (the by-Param failure DynPipe reports after pruning).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.schedule import W_SHARE, simulate

Floats = Sequence[float] | np.ndarray
"""Per-layer or per-stage numbers: a list from a config or a test, or a 1-D array from a profile."""

__all__ = [
    "StagePartition",
    "clears_hysteresis",
    "diffuse",
    "imbalance",
    "iteration_time",
    "migration_layers",
    "partition_by_params",
    "partition_by_time",
    "partition_uniform",
    "pipeline_time",
    "plan_repack",
    "replay_time",
    "stage_loads",
    "should_adopt",
]


def _check(costs: Floats, num_stages: int, what: str = "costs") -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ConfigError(f"{what} must be a non-empty list of per-layer numbers; got shape {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ConfigError(f"{what} must be finite and non-negative; got {c.tolist()}")
    if num_stages < 1:
        raise ConfigError(f"the number of stages must be at least 1; got {num_stages}")
    if num_stages > c.size:
        raise ConfigError(f"{num_stages} stages for {c.size} layers: every stage needs at least one layer; "
                          f"use at most {c.size} stages")
    return c


def stage_loads(costs: Floats, sizes: Sequence[int], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """Sum of layer costs per stage (plus the pinned embedding/head extras)."""
    c = np.asarray(costs, dtype=np.float64)
    if sum(sizes) != c.size or any(s < 1 for s in sizes):
        raise ConfigError(f"partition {list(sizes)} must give every stage at least one layer and cover "
                          f"exactly {c.size} layers")
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    loads = [float(c[bounds[p]:bounds[p + 1]].sum()) for p in range(len(sizes))]
    loads[0] += first_extra
    loads[-1] += last_extra
    return loads


def partition_by_time(costs: Floats, num_stages: int, memory: Floats | None = None,
                      capacity: float | Floats | None = None, first_extra: float = 0.0,
                      last_extra: float = 0.0, first_memory: float = 0.0, last_memory: float = 0.0,
                      current: Sequence[int] | None = None) -> list[int]:
    """The exact min-max contiguous partition (no empty stage), under per-stage memory caps.

    `memory[l]` is layer l's bytes on a stage (parameters, gradients, optimizer state, activations in
    flight); `capacity` is one cap for every stage or one per stage; `first_memory`/`last_memory` are the
    pinned embedding/head bytes. The min-max partition is rarely unique (any layer off the slowest stage can
    often sit on either side of a boundary). With `current` (the partition in use), the optimal partition that
    moves the fewest layers from it is returned, so a tie never proposes a migration that buys nothing;
    remaining ties, and every tie without `current`, go to one fixed choice (the backtrack takes, from the last
    stage back, the earliest boundary whose prefix is optimal for its own sub-problem: not always the partition
    with the earliest boundaries, e.g. [2, 1, 1] for costs [1, 1, 2, 5] on 3 stages where [1, 2, 1] ties), so
    every rank computes the same answer from the same inputs.

    Dynamic programming over (stage, prefix) (`_contiguous_min`), exact: no epsilon of the bisection-plus-probe
    scheme, which DynPipe's extraction found can also leave a stage empty.
    """
    c = _check(costs, num_stages)
    L, P = c.size, num_stages
    mem = np.zeros(L) if memory is None else _check(memory, 1, "memory")
    if mem.size != L:
        raise ConfigError(f"memory has {mem.size} entries but costs has {L}: give one value per layer")
    # prefix-sum differences round differently from the direct sums a user checks against the cap: allow
    # the last few ulps, so a stage whose layers exactly fill the cap counts as fitting
    caps = _caps(capacity, P) * (1 + 1e-12) + 1e-12
    pre_c = np.concatenate([[0.0], np.cumsum(c)])
    pre_m = np.concatenate([[0.0], np.cumsum(mem)])

    ends, starts = np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]  # stage p covers layers [k, i): [i, k]

    @functools.cache  # the second pass reads the same tables as the first
    def stage(p: int) -> tuple[np.ndarray, np.ndarray]:
        """Stage p's load over [k, i) for every (i, k), and whether that span is a stage that fits its cap."""
        load = pre_c[ends] - pre_c[starts] + (first_extra if p == 0 else 0.0) + (last_extra if p == P - 1 else 0.0)
        used = pre_m[ends] - pre_m[starts] + (first_memory if p == 0 else 0.0) + (last_memory if p == P - 1 else 0.0)
        return load, (starts < ends) & (used <= caps[p])

    def max_load(p: int) -> np.ndarray:
        load, ok = stage(p)
        return np.where(ok, load, np.inf)

    top, arg = _contiguous_min(P, L, max_load, np.maximum, -np.inf)
    if not np.isfinite(top):
        raise ConfigError(f"no partition of {L} layers into {num_stages} stages fits the memory caps "
                          f"{_caps(capacity, P).tolist()} (total layer memory {pre_m[-1]:.4g}): raise the cap, use "
                          f"more stages, or reduce per-layer memory")
    if current is None:
        return _backtrack(arg, P, L)
    stage_loads(c, current)  # validates `current` against these layers
    if len(current) != P:
        raise ConfigError(f"the current partition {list(current)} has {len(current)} stages, not {P}")
    # second pass, exact: among partitions whose every stage load is at most the optimum (a few ulps of slack
    # for the prefix sums), the fewest layers off their current stage; moves add up stage by stage
    bound = top * (1 + 1e-12) + 1e-12
    owner = np.repeat(np.arange(P), current)
    off_pre = np.concatenate([np.zeros((P, 1)), np.cumsum(owner[None, :] != np.arange(P)[:, None], axis=1)], axis=1)

    def moves(p: int) -> np.ndarray:
        load, ok = stage(p)
        return np.where(ok & (load <= bound), off_pre[p][ends] - off_pre[p][starts], np.inf)

    return _backtrack(_contiguous_min(P, L, moves, np.add, 0.0)[1], P, L)


def _contiguous_min(P: int, L: int, value: Callable[[int], np.ndarray],
                    fold: Callable[[np.ndarray, np.ndarray], np.ndarray], start: float) -> tuple[float, np.ndarray]:
    """Dynamic programming over (stage, prefix): the least `fold` of stage values over partitions of layers
    [0, L) into P non-empty contiguous stages. `value(p)[i, k]` is stage p over layers [k, i) (inf: not a
    stage); `start` is the fold's identity. Returns (the optimum, the argmin starts for `_backtrack`); among
    equal optima, per prefix, the earliest start (argmin takes the first minimum), which fixes the choice but is
    not the earliest boundaries overall (`partition_by_time`). O(P * L^2) arithmetic, one numpy
    [L + 1, L + 1] table per stage."""
    best = np.full((P + 1, L + 1), np.inf)
    best[0, 0] = start
    arg = np.zeros((P + 1, L + 1), dtype=np.int64)
    for p in range(P):
        cand = fold(best[p][None, :], value(p))  # [i, k]: earlier stages cover [0, k), this one [k, i)
        arg[p + 1] = np.argmin(cand, axis=1)
        best[p + 1] = np.take_along_axis(cand, arg[p + 1][:, None], axis=1)[:, 0]
    return float(best[P, L]), arg[1:]


def _caps(capacity: float | Floats | None, P: int) -> np.ndarray:
    if capacity is None:
        return np.full(P, np.inf)
    caps = np.broadcast_to(np.asarray(capacity, dtype=np.float64), (P,)).copy() if np.ndim(capacity) == 0 \
        else np.asarray(capacity, dtype=np.float64)
    if caps.shape != (P,) or np.any(caps <= 0):
        raise ConfigError(f"capacity must be one positive number or one per stage ({P}); got {capacity}")
    return caps


def _backtrack(arg: np.ndarray, P: int, L: int) -> list[int]:
    bounds = [L]
    i = L
    for p in range(P - 1, 0, -1):
        i = int(arg[p, i])
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [bounds[p + 1] - bounds[p] for p in range(P)]


def partition_by_params(param_counts: Floats, num_stages: int, *, memory: Floats | None = None,
                        capacity: float | Floats | None = None, first_extra: float = 0.0, last_extra: float = 0.0,
                        first_memory: float = 0.0, last_memory: float = 0.0) -> list[int]:
    """DeepSpeed's `parameters` method: the same exact min-max partition over parameter counts."""
    return partition_by_time(param_counts, num_stages, memory=memory, capacity=capacity, first_extra=first_extra,
                             last_extra=last_extra, first_memory=first_memory, last_memory=last_memory)


def partition_uniform(num_layers: int, num_stages: int) -> list[int]:
    """Megatron's static split: equal layer counts, the remainder spread over the first stages."""
    if num_stages < 1 or num_layers < num_stages:
        raise ConfigError(f"{num_stages} stages for {num_layers} layers: every stage needs at least one layer")
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if p < r else 0) for p in range(num_stages)]


def diffuse(costs: Floats, sizes: Sequence[int], memory: Floats | None = None,
            capacity: float | None = None, max_rounds: int = 5, first_extra: float = 0.0,
            last_extra: float = 0.0, first_memory: float = 0.0, last_memory: float = 0.0) -> list[int]:
    """DynMo's diffusion balancer restricted to adjacent-stage boundary moves, under the memory cap `capacity`
    (`memory[l]` a layer's bytes, `first_memory`/`last_memory` the pinned embedding/head bytes, as
    `partition_by_time`'s): a move never puts a stage over the cap (or further over it).

    Each round visits the stages that are above the mean load (status fixed per round, as Algorithm 3). A stage
    gives one boundary layer to its lighter adjacent neighbour when that lowers the variance of the stage loads:
    a move of cost c from load a to load b lowers it iff 0 < c < a - b, and then both new loads are below a.
    Where no neighbour is light enough (a layer as heavy as the gap: a smooth gradient of loads stalls the
    one-hop rule with every stage above the mean), the stage sends a layer down a chain of h adjacent stages
    instead: every boundary on the chain moves one layer the same way (the stage gives its boundary layer, each
    stage on the way passes its own boundary layer on, the last one keeps what it receives). A chain is taken
    when it lowers the sum of squared loads without raising the chain's maximum, shortest first (fewest layers
    migrate), the largest drop among equal lengths. So the maximum never rises, the variance falls with every
    move, layer order never changes and stages never become empty. The one-hop move is the chain of length 1.
    """
    c = _check(costs, len(sizes))
    mem = np.zeros(c.size) if memory is None else _check(memory, 1, "memory")
    if mem.size != c.size:
        raise ConfigError(f"memory has {mem.size} entries but costs has {c.size}: give one value per layer")
    cap = np.inf if capacity is None else float(capacity)
    sizes = list(sizes)
    stage_loads(c, sizes)  # validates the partition
    for _ in range(max_rounds):
        loads = stage_loads(c, sizes, first_extra, last_extra)
        mean = sum(loads) / len(loads)
        moved = False
        for p in [q for q, load in enumerate(loads) if load > mean]:
            moved |= _move_boundary_layer(c, mem, cap, sizes, p, first_extra, last_extra, first_memory,
                                          last_memory)
        if not moved:
            break
    return sizes


def _move_boundary_layer(c: np.ndarray, mem: np.ndarray, cap: float, sizes: list[int], p: int,
                         first_extra: float, last_extra: float, first_memory: float, last_memory: float) -> bool:
    """Move one boundary layer of stage p along the shortest improving chain (see `diffuse`); False if none."""
    if sizes[p] <= 1:
        return False
    loads = np.asarray(stage_loads(c, sizes, first_extra, last_extra), dtype=np.float64)
    P = len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)  # stage j holds layers [starts[j], starts[j+1])
    stage_mem = np.array([mem[starts[j]:starts[j + 1]].sum() for j in range(P)])
    stage_mem[0] += first_memory
    stage_mem[-1] += last_memory
    for hops in range(1, P):
        options = []  # (drop in the sum of squares, direction): the larger drop, then the lower neighbour
        for d in (-1, 1):
            if not 0 <= p + hops * d < P:
                continue
            path = [p + i * d for i in range(hops + 1)]
            # the layer each stage on the path sends on: its boundary layer on the chain's side
            sent = [starts[j + 1] - 1 if d > 0 else starts[j] for j in path[:-1]]
            out_c = np.array([c[x] for x in sent] + [0.0])
            in_c = np.array([0.0] + [c[x] for x in sent])
            out_m = np.array([mem[x] for x in sent] + [0.0])
            in_m = np.array([0.0] + [mem[x] for x in sent])
            old = loads[path]
            new = old - out_c + in_c
            new_mem = stage_mem[path] - out_m + in_m
            drop = float((old ** 2).sum() - (new ** 2).sum())
            fits = all(m <= max(cap, o) for m, o in zip(new_mem[1:], stage_mem[path][1:]))
            if drop > 1e-12 * max(1.0, float((old ** 2).sum())) and new.max() <= old.max() and fits:
                options.append((drop, -d))
        if options:
            _, neg_d = max(options)
            d = -neg_d
            sizes[p] -= 1
            sizes[p + hops * d] += 1
            return True
    return False


def imbalance(loads: Floats) -> float:
    """max / mean of stage loads (1.0 is perfect balance; DynMo's imbalance metric)."""
    arr = np.asarray(loads, dtype=np.float64)
    mean = arr.mean()
    return float(arr.max() / mean) if mean > 0 else 1.0


def pipeline_time(loads: Floats, num_micro_batches: int) -> float:
    """Iteration time of GPipe/1F1B with equal micro-batches: (M + P - 1) x the slowest stage's time per
    micro-batch (loads are per-micro-batch forward+backward seconds); exact for equal stages."""
    return (num_micro_batches + len(loads) - 1) * max(loads)


def migration_layers(old: Sequence[int], new: Sequence[int]) -> list[tuple[int, int, int]]:
    """(layer, from stage, to stage) for every layer whose stage changes between two partitions."""
    if sum(old) != sum(new):
        raise ConfigError(f"partitions {list(old)} and {list(new)} cover different numbers of layers")
    owner_old = np.repeat(np.arange(len(old)), old)
    owner_new = np.repeat(np.arange(len(new)), new)
    return [(int(i), int(a), int(b)) for i, (a, b) in enumerate(zip(owner_old, owner_new)) if a != b]


def iteration_time(loads: Floats, num_micro_batches: int, comm_s: float = 0.0) -> float:
    """Iteration time with unequal stages (DynPipe's model): (M - 1) x the slowest stage + the sum of all stages
    (the fill and drain of one micro-batch) + 2 (P - 1) boundary transfers (activation forward, gradient back).
    Without transfers: exact for GPipe when one stage has both the largest forward and the largest backward (a
    backward a fixed multiple of its forward, as here, where loads are sums), otherwise below GPipe's sum f + sum b
    + (M - 1)(max f + max b) (f [2, 1], b [1, 3], M 2: 11 against 12); an upper bound for 1F1B. With them 1F1B can
    take longer, since it exposes a transfer on every micro-batch (2 stages, 4 micro-batches, forward 1, backward 2,
    transfer 1: 17 here, 19 replayed); `schedule.simulate` replays either. Loads are per-micro-batch
    forward+backward seconds; `comm_s` is one boundary transfer."""
    return (num_micro_batches - 1) * max(loads) + sum(loads) + 2 * (len(loads) - 1) * comm_s


def replay_time(fwd_loads: Floats, bwd_loads: Floats, num_micro_batches: int,
                comm_s: float = 0.0, schedule: str = "1f1b", w_share: float | Sequence[float] = W_SHARE) -> float:
    """Iteration time by replaying the schedule op by op (`schedule.simulate`) from each stage's forward and
    backward seconds per micro-batch, with `comm_s` per boundary transfer.

    `iteration_time` is exact for GPipe (where one stage has the largest forward and backward) but only an upper
    bound for 1F1B, and not a uniform one: it charges
    the fill and drain of every stage in full, while in 1F1B a slowest *first* stage hides most of the later
    stages' fill behind its warm-up forwards. Measured on the 4-stage benchmark (Mixture-of-Depths, first
    stage slowest, dilate 3): static 2.99 s per iteration, `iteration_time` 3.12 s, the replay 2.95-2.97 s;
    the rebalanced partition 2.83 s, 2.82 s and 2.76-2.79 s. The upper bound thus predicted a 1.18x gain
    where the replay predicted, and the run measured, 1.07x. The planner uses the replay for adoption and
    re-packing (`PipelineRunner`); `iteration_time` stays the closed form for `moebal plan stages`.
    `w_share` (zero bubble only): the share of each stage's backward that is deferred weight gradients.
    """
    if len(fwd_loads) != len(bwd_loads):
        raise ConfigError(f"{len(fwd_loads)} forward loads but {len(bwd_loads)} backward loads: one of each per "
                          f"stage")
    return simulate(schedule, list(fwd_loads), list(bwd_loads), num_micro_batches, comm_s, w_share)[0]


def should_adopt(costs: Floats, current: Sequence[int], proposed: Sequence[int], num_micro_batches: int,
                 interval_iters: int, layer_bytes: Floats, bandwidth_Bps: float, latency_s: float = 0.0,
                 first_extra: float = 0.0, last_extra: float = 0.0, comm_s: float | None = None,
                 time_fn: Callable[[Sequence[int]], float] | None = None) -> tuple[bool, float, float]:
    """Adopt a new partition only when its predicted gain over the next interval exceeds the migration cost.

    gain = (T_iter(current) - T_iter(proposed)) x interval_iters; cost = bytes of every moved layer (weights,
    gradients and optimizer state: give `layer_bytes` accordingly) / bandwidth + latency per moved layer.
    T_iter is `time_fn(sizes)` when given (the runner's schedule replay), else `pipeline_time`, or
    `iteration_time` with boundary transfers of `comm_s` when that is given. Returns (adopt, gain_s, cost_s).
    """
    def t_iter(sizes: Sequence[int]) -> float:
        if time_fn is not None:
            return time_fn(sizes)
        loads = stage_loads(costs, sizes, first_extra, last_extra)
        if comm_s is None:
            return pipeline_time(loads, num_micro_batches)
        return iteration_time(loads, num_micro_batches, comm_s)

    moved = migration_layers(current, proposed)
    cost = sum(layer_bytes[i] for i, _, _ in moved) / bandwidth_Bps + latency_s * len(moved)
    gain = (t_iter(current) - t_iter(proposed)) * interval_iters
    return bool(gain > cost and moved), float(gain), float(cost)


def clears_hysteresis(t_cur: float, t_new: float, min_gain: float, streak: int, confirm: int,
                      confirm_fraction: float = 0.2) -> bool:
    """Whether a proposal predicted at `t_new` s per iteration (current partition: `t_cur`) is worth moving to.

    At once when it gains at least `min_gain` of the iteration. A smaller gain, at least `confirm_fraction` of
    `min_gain` (`pipeline.confirm_fraction`), only when the same partition has now been proposed at `confirm`
    consecutive plan points (`streak` counts them, this one included; `confirm` 0 never): noise makes a
    different winner at each plan point, a real but small improvement keeps winning. (With one threshold
    alone, finer partition units found gains of 2-3 % at every plan point and never took them.)
    """
    if t_new <= (1.0 - min_gain) * t_cur:
        return True
    return confirm > 0 and streak >= confirm and t_new <= (1.0 - confirm_fraction * min_gain) * t_cur


def plan_repack(costs: Floats, num_stages: int, num_micro_batches: int, slack: float = 0.1,
                min_stages: int = 2, memory: Floats | None = None, capacity: float | None = None,
                comm_s: float = 0.0, first_extra: float = 0.0, last_extra: float = 0.0, first_memory: float = 0.0,
                last_memory: float = 0.0,
                time_fn: Callable[[Sequence[int]], float] | None = None) -> list[int] | None:
    """The partition over the fewest stages P' < P whose predicted iteration time is within `slack` of the best
    P-stage partition's (so throughput per rank rises while throughput drops by at most `slack`), or None.
    Predicted times are `time_fn(sizes)` when given (the runner's schedule replay), else `iteration_time`.

    This settles the papers' open re-pack trigger: DynMo's threshold tau is never given and both papers take
    the target count from the user. Here the trigger is the cost model itself: when the work has shrunk so
    far that fewer stages run it almost as fast (their fill/drain and transfers weigh less), pack. Stages
    stay contiguous (exact min-max partition under the memory caps, never DynPipe's first-fit, which can
    break order) and never fewer than `min_stages`.
    """
    def fit(p: int) -> list[int]:
        return partition_by_time(costs, p, memory=memory, capacity=capacity, first_extra=first_extra,
                                 last_extra=last_extra, first_memory=first_memory, last_memory=last_memory)

    try:
        best = fit(num_stages)
    except ConfigError:
        return None  # not even P stages fit the caps: nothing to pack
    def t_iter(sizes: Sequence[int]) -> float:
        if time_fn is not None:
            return time_fn(sizes)
        return iteration_time(stage_loads(costs, sizes, first_extra, last_extra), num_micro_batches, comm_s)

    t_best = t_iter(best)
    for p in range(max(min_stages, 1), num_stages):
        try:
            sizes = fit(p)
        except ConfigError:
            continue  # does not fit the memory caps on p stages
        if t_iter(sizes) <= (1.0 + slack) * t_best:
            return sizes
    return None


@dataclass(frozen=True)
class StagePartition:
    """A plan for the layer granularity: layers per stage over the ranks of one pipeline (JSON-serialisable).

    `ranks` are the pipeline's global ranks in order; `sizes[p]` layers run on ranks[p]. A re-pack plan has
    fewer ranks than the pipeline it replaces; `released` lists the ranks that leave.
    """

    sizes: tuple[int, ...]
    ranks: tuple[int, ...]
    step: int = 0
    balancer: str = "static"
    released: tuple[int, ...] = ()
    predicted_time_s: float | None = None
    previous_time_s: float | None = None
    gain_s: float | None = None
    migration_cost_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.ranks) or any(s < 1 for s in self.sizes):
            raise ConfigError(f"StagePartition: sizes {list(self.sizes)} must give each of the ranks "
                              f"{list(self.ranks)} at least one layer")

    @property
    def bounds(self) -> list[int]:
        return [int(b) for b in np.concatenate([[0], np.cumsum(self.sizes)])]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sizes"], d["ranks"], d["released"] = list(self.sizes), list(self.ranks), list(self.released)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePartition:
        d = dict(d)
        for k in ("sizes", "ranks", "released"):
            d[k] = tuple(int(v) for v in d.get(k, ()))
        return cls(**d)
