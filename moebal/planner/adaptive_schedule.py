"""Schedules for micro-batches of different durations: 1F1B, DynaPipe's adaptive (cyclic) schedule, and the
choice between them by simulation.

Shape legend: P = stages, M = micro-batches of one pipeline (one data-parallel replica).

A schedule is, per stage, the ordered list of operations `(kind, j)`: "F" (forward) or "B" (backward) of
micro-batch j. Micro-batches are injected into the first stage in an *order* (a permutation of 0..M-1).

* `one_f_one_b`: PipeDream-flush over the injection order: stage p runs P - p - 1 warm-up forwards, then
  alternates, then drains (`schedule.one_f_one_b` with the injection order, for every stage).
  At most P - p micro-batches are in flight on stage p; with variable durations its stages have no safety
  stock in the steady phase, so any slow micro-batch idles the stages behind it (DynaPipe §6.1).
* `adaptive`: DynaPipe's Alg. 1, cleaned up (seed §6.3). Time advances in cycles; in a cycle every stage
  runs at most one backward, then at most one forward, each taken from its ready queue (ops unlocked in a
  cycle become ready in the next); a forward is admitted only while the stage's stored activations stay
  within its memory limit, otherwise it is delayed until backwards free memory. Gaps of the paper settled
  here: the backward *frees* memory (the seed's "m_j = a" is "m_j -= a"); a forward whose activation alone
  exceeds the limit runs when nothing else is in flight (else the loop never ends); the limit test is
  `mem + a <= limit` (so per-stage limits of P - p unit activations give exactly 1F1B's order, tested).
  The cycles only *derive* the per-stage orders; at run time every stage runs its order as soon as the
  inputs arrive (no lockstep).
* `simulate`: event-driven replay of per-stage orders on per-(stage, micro-batch) times: an op starts when
  its stage is free and its input has arrived (+ a transfer time). It gives the makespan and the timeline
  the communication plan is derived from (`instructions.py`), and the stored-activation peak of every stage.
* `choose_schedule`: simulate both schedules over a few injection orders (micro-batches clustered by
  duration into 3-4 groups; every permutation of the groups, plus the planner's order) and keep the
  shortest simulated makespan whose memory peaks fit (the reference implementation's rule). 1F1B is always
  a candidate: with a uniform memory cap the cyclic order can be worse than 1F1B (seed §6.3, tested).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.schedule import one_f_one_b as stage_one_f_one_b

__all__ = ["DYN_SCHEDULES", "Timeline", "adaptive", "choose_schedule", "cluster_orders", "memory_peaks",
           "one_f_one_b", "simulate"]

Op = tuple[str, int]
DYN_SCHEDULES = ("1f1b", "adaptive")


def one_f_one_b(num_stages: int, order: Sequence[int]) -> list[list[Op]]:
    """1F1B per stage over micro-batches injected in `order` (`planner.schedule.one_f_one_b` for every stage)."""
    return [stage_one_f_one_b(num_stages, p, len(order), order) for p in range(num_stages)]


def adaptive(num_stages: int, order: Sequence[int], act_PM: np.ndarray | None = None,
             limit_P: Sequence[float] | None = None) -> list[list[Op]]:
    """DynaPipe's memory-aware adaptive schedule (Alg. 1): per-stage orders from cycles of at most one
    backward and one forward per stage; forwards wait while they would exceed the stage's memory limit."""
    P, M = num_stages, len(order)
    act = np.ones((P, max(M, 1))) if act_PM is None else np.asarray(act_PM, dtype=np.float64)
    limit = [np.inf] * P if limit_P is None else [float(x) for x in limit_P]
    out: list[list[Op]] = [[] for _ in range(P)]
    ready_f: list[deque[int]] = [deque() for _ in range(P)]
    ready_b: list[deque[int]] = [deque() for _ in range(P)]
    ready_f[0].extend(order)
    mem = [0.0] * P
    alive = [0] * P
    for _cycle in range(4 * (M + P) * (P + 1) + 8):  # every cycle retires an op once the pipe is warm
        if not any(ready_f[p] or ready_b[p] for p in range(P)):
            return out
        new_f: list[list[int]] = [[] for _ in range(P)]
        new_b: list[list[int]] = [[] for _ in range(P)]
        for p in range(P):
            if ready_b[p]:
                j = ready_b[p].popleft()
                mem[p] -= act[p, j]
                alive[p] -= 1
                out[p].append(("B", j))
                if p > 0:
                    new_b[p - 1].append(j)
            if ready_f[p]:
                j = ready_f[p][0]
                if mem[p] + act[p, j] <= limit[p] or alive[p] == 0:  # one micro-batch always runs
                    ready_f[p].popleft()
                    mem[p] += act[p, j]
                    alive[p] += 1
                    out[p].append(("F", j))
                    (new_f[p + 1] if p < P - 1 else new_b[p]).append(j)
        for p in range(P):
            ready_f[p].extend(new_f[p])
            ready_b[p].extend(new_b[p])
    raise AssertionError("adaptive schedule did not finish")  # programmer invariant: each cycle makes progress


@dataclass(frozen=True)
class Timeline:
    """A simulated iteration: makespan, every op's (stage, kind, micro-batch, start, end), peak memory."""

    makespan: float
    ops: tuple[tuple[int, str, int, float, float], ...]
    peak_P: tuple[float, ...]


def simulate(orders: Sequence[Sequence[Op]], fwd_PM: np.ndarray, bwd_PM: np.ndarray, comm_s: float = 0.0,
             act_PM: np.ndarray | None = None) -> Timeline:
    """Replay per-stage orders: an op starts when its stage is free and its input is there (+ comm_s across
    stages). Raises ConfigError when the orders wait on each other in a cycle (not a valid schedule)."""
    P = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    ops: list[tuple[int, str, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(P):
            while pos[p] < len(orders[p]):
                kind, j = orders[p][pos[p]]
                if kind == "F":
                    dep, hop = (("F", p - 1, j), comm_s) if p > 0 else (None, 0.0)
                else:
                    dep, hop = (("B", p + 1, j), comm_s) if p < P - 1 else (("F", p, j), 0.0)
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + hop if dep is not None else 0.0
                start = max(free[p], ready)
                dur = max(float((fwd_PM if kind == "F" else bwd_PM)[p, j]), 1e-12)
                done[(kind, p, j)] = free[p] = start + dur
                ops.append((p, kind, j, start, start + dur))
                pos[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {p: orders[p][pos[p]] for p in range(P) if pos[p] < len(orders[p])}
            raise ConfigError(f"the per-stage orders wait on each other (stage: next op) {stuck}: not a schedule")
    peak = memory_peaks(orders, act_PM) if act_PM is not None else tuple(0.0 for _ in range(P))
    return Timeline(makespan=max(free) if free else 0.0, ops=tuple(ops), peak_P=tuple(peak))


def memory_peaks(orders: Sequence[Sequence[Op]], act_PM: np.ndarray) -> tuple[float, ...]:
    """Per stage, the largest sum of stored activations of the micro-batches in flight (F done, B not)."""
    peaks = []
    for p, order in enumerate(orders):
        cur = peak = 0.0
        for kind, j in order:
            cur += act_PM[p, j] if kind == "F" else -act_PM[p, j]
            peak = max(peak, cur)
        peaks.append(float(peak))
    return tuple(peaks)


def cluster_orders(times_M: Sequence[float], clusters: int | None = None) -> list[list[int]]:
    """Injection orders to try: micro-batches grouped by duration (1-D k-means, 3 groups when there are more
    than 20 micro-batches, else 4, as the reference), every permutation of the groups with members in their
    planner order, and the planner's order itself first. Deterministic."""
    t = np.asarray(times_M, dtype=np.float64)
    M = len(t)
    base = list(range(M))
    k = min(clusters if clusters is not None else (3 if M > 20 else 4), M)
    if k <= 1:
        return [base]
    centers = np.quantile(t, (np.arange(k) + 0.5) / k)
    label = np.zeros(M, dtype=np.int64)
    for _ in range(25):
        label = np.abs(t[:, None] - centers[None, :]).argmin(axis=1)
        new = np.array([t[label == c].mean() if (label == c).any() else centers[c] for c in range(k)])
        if np.allclose(new, centers):
            break
        centers = new
    groups = [[j for j in base if label[j] == c] for c in np.argsort(centers)]
    groups = [g for g in groups if g]
    out, seen = [base], {tuple(base)}
    for perm in itertools.permutations(range(len(groups))):
        order = [j for g in perm for j in groups[g]]
        if tuple(order) not in seen:
            seen.add(tuple(order))
            out.append(order)
    return out


@dataclass(frozen=True)
class ScheduleChoice:
    """The schedule kept for one pipeline, and what the simulation said about every candidate."""

    name: str
    order: tuple[int, ...]
    timeline: Timeline
    candidates: tuple[tuple[str, float, bool], ...]
    """(schedule, best makespan over the orders tried, whether any order fit in memory)."""


def choose_schedule(fwd_PM: np.ndarray, bwd_PM: np.ndarray, act_PM: np.ndarray, limit: float | None = None,
                    schedules: Sequence[str] = DYN_SCHEDULES, comm_s: float = 0.0,
                    clusters: int | None = None) -> ScheduleChoice:
    """Simulate every schedule over the clustered injection orders; the shortest makespan that fits wins
    (ties keep the earlier schedule and order: 1F1B, then the planner's order)."""
    for name in schedules:
        if name not in DYN_SCHEDULES:
            raise ConfigError(f"unknown micro-batch schedule {name!r}; choose among {', '.join(DYN_SCHEDULES)}")
    P, M = fwd_PM.shape
    lim = np.inf if limit is None else float(limit)
    times = (fwd_PM + bwd_PM).max(axis=0)
    orders = cluster_orders(times, clusters)
    best: tuple[float, str, list[int], Timeline] | None = None
    fallback: tuple[float, str, list[int], Timeline] | None = None
    summary = []
    for name in schedules:
        best_here, fits_here = np.inf, False
        for order in orders:
            ops = (one_f_one_b(P, order) if name == "1f1b"
                   else adaptive(P, order, act_PM, [lim] * P if limit is not None else None))
            tl = simulate(ops, fwd_PM, bwd_PM, comm_s, act_PM)
            fits = max(tl.peak_P, default=0.0) <= lim * (1 + 1e-9)
            best_here = min(best_here, tl.makespan)
            fits_here |= fits
            cand = (tl.makespan, name, order, tl)
            if fits and (best is None or tl.makespan < best[0]):
                best = cand
            if fallback is None or max(tl.peak_P) < max(fallback[3].peak_P):
                fallback = cand
        summary.append((name, float(best_here), fits_here))
    chosen = best if best is not None else fallback  # nothing fits: the lowest peak (single micro-batches over)
    assert chosen is not None
    _, name, order, tl = chosen
    return ScheduleChoice(name=name, order=tuple(order), timeline=tl, candidates=tuple(summary))
