"""DynaPipe micro-batching: split one mini-batch of variable-length samples into micro-batches of different
sizes and lengths, assign them to data-parallel pipelines, order and schedule them, plan the communication.

Shape legend: N = samples of the mini-batch, K = most rows a micro-batch may have, C = candidate time
limits, P = stages (c in the paper), D = data-parallel replicas, M = micro-batches.

Pure: lengths and a `MicroBatchCost` in, a frozen `MicroBatchPlan` out (JSON-serialisable, replayable); no
torch, so planning runs in background worker processes (moebal/balance/microbatch_workers.py).

The steps (DynaPipe §4-§7):
  1. check the lengths (an empty sample or one longer than the model's maximum is an error naming it);
  2. sort by length, descending (the reference's direction: a run's padded length is its first sample's,
     and memory grows monotonically along a run);
  3. the exact DP split (Eq2) of the sorted list into contiguous runs, for every candidate limit t_max on a
     micro-batch's time, under a per-micro-batch memory limit; each candidate's partition is scored by
     Eq1 with its *actual* maximum, (P - 1) max_M t(M) + sum_M t(M) / D, and the best kept;
  4. data parallelism: the micro-batches are spread over the D replicas by Karmarkar-Karp (largest
     differencing) on their times;
  5. per replica: injection order and schedule chosen by simulation (`adaptive_schedule.choose_schedule`),
     then the communication plan from the simulated timeline (`instructions.build_comm_plan`), proved
     deadlock-free by `instructions.check_plan` before the plan is returned.

Gaps of the paper, settled (docs/microbatching.md has the long form):
  * Eq2's index range is 0 <= i <= n - 1 (the paper's 1 <= i misses one micro-batch holding the prefix);
  * t(M) is the bottleneck stage's forward + backward time (`MicroBatchCost.time`): per-stage, as Eq1
    implies, and the slowest stage where embedding or head make stages unequal;
  * thinning of the candidate limits: the paper keeps candidates 5 us apart. Here the spacing is relative,
    delta = thin * LB / (P - 1) with LB = (P - 1 + 1/D) * min_k t(first k samples), a lower bound on the
    optimum (the longest sample is in the first run). Each window of width delta is represented by its
    *upper* end and partitions are scored by their actual maximum, so the thinned plan is at most
    (P - 1) delta = thin * LB <= thin * OPT worse than the exact one (tested against the unthinned DP);
  * the DP runs at the limits a bound lets hold the optimum (`_search`), not at every one: a batch of
    thousands of samples leaves thousands of limits, each a DP over the batch;
  * one DP call solves its limits in blocks (`_dp`): per prefix end, one vector step per block over the runs
    its largest limit may allow, masked only where its smallest may not; the same sums and argmins as one
    loop over every run (tests/unit/test_microbatch_dp.py), at a fraction of the work;
  * memory: the DP limits each micro-batch to memory / P (1F1B keeps up to P micro-batches in flight on
    the first stage); when even that cannot hold the longest sample, it retries with the whole budget (one
    micro-batch must fit) and leaves the rest to the memory-aware adaptive schedule (the reference's
    escalation); when one sample alone does not fit, that is an error naming it;
  * padded length: the run's longest sample rounded up to `pad_multiple` (8 in the reference; configurable);
  * loss normalisation is per token (the engine's business; see docs/microbatching.md).
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.adaptive_schedule import DYN_SCHEDULES, choose_schedule, one_f_one_b, simulate
from moebal.planner.instructions import build_comm_plan, check_plan
from moebal.planner.microbatch_cost import MicroBatchCost

__all__ = ["METHODS", "MicroBatch", "MicroBatchPlan", "check_lengths", "dp_split", "iteration_objective",
           "karmarkar_karp", "plan_microbatches", "split_packing", "split_padding", "split_tokens"]

METHODS = ("dynamic", "padding", "packing", "tokens")


def check_lengths(lengths: Sequence[Any], max_len: int | None = None, what: str = "sample") -> np.ndarray:
    """Lengths as int64, or a ConfigError naming the first bad one and the fix."""
    arr = np.asarray(list(lengths), dtype=object)
    if arr.size == 0:
        raise ConfigError("no samples: the mini-batch is empty")
    out = np.zeros(arr.size, dtype=np.int64)
    for i, v in enumerate(arr.tolist()):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer, float)) or (isinstance(v, float)
                                                                                   and not v.is_integer()):
            raise ConfigError(f"{what} {i}: length {v!r} is not a whole number of tokens")
        if v <= 0:
            raise ConfigError(f"{what} {i} has length {int(v)}: every sample needs at least one token "
                              f"(drop empty samples)")
        if max_len is not None and v > max_len:
            raise ConfigError(f"{what} {i} has length {int(v)}, longer than the model's maximum {max_len}: "
                              f"truncate or cut long samples (data.seq_len) or raise model.max_seq_len")
        out[i] = int(v)
    return out


def _pad(s: Any, multiple: int) -> Any:
    return -(-np.asarray(s) // multiple) * multiple


def iteration_objective(times: Sequence[float], stages: int, dp: int = 1) -> float:
    """Eq1 (with §5.3's data-parallel bound): (P - 1) max t + sum t / D."""
    t = np.asarray(times, dtype=np.float64)
    return float((stages - 1) * t.max() + t.sum() / dp) if t.size else 0.0


# ---------------------------------------------------------------------------------------------------------
# the DP (Eq2)


@dataclass(frozen=True)
class SplitResult:
    """Contiguous runs [start, end) of the sorted samples, their times, and how the DP got there."""

    runs: tuple[tuple[int, int], ...]
    times: tuple[float, ...]
    objective: float
    candidates: int
    candidates_exact: int
    delta: float
    memory_limit: float | None
    memory_mode: str
    evaluated: int = 0
    """Candidates whose DP ran (`_search`: the others' bounds could not beat the best)."""


@dataclass(frozen=True)
class _Runs:
    """Every run of the sorted samples, costed once per distinct padded length G: a run's time and memory depend
    only on its rows k and its first sample's padded length (at most max_len / pad_multiple values)."""

    t_GK: np.ndarray
    """Time of a run of k samples whose first sample is in length group g (inf where the table has none)."""
    mem_GK: np.ndarray | None
    """Its memory; None when no memory limit asks for it."""
    grp: np.ndarray
    """[N] the length group of each sorted sample."""
    span_G: np.ndarray
    """[G] the most samples a run starting in the group can have (N less its first index, at most K)."""


def _run_tables(L_desc: np.ndarray, cost: MicroBatchCost, pad_multiple: int, memory: bool) -> _Runs:
    """The run tables of descending lengths (the memory table only when `memory`)."""
    N = len(L_desc)
    K = int(min(N, cost.rows_grid[-1]))
    k = np.arange(1, K + 1)
    s, first, grp = np.unique(_pad(L_desc, pad_multiple), return_index=True, return_inverse=True)
    return _Runs(t_GK=cost.time(k[None, :], s[:, None]), mem_GK=cost.memory(k[None, :], s[:, None]) if memory
                 else None, grp=grp.reshape(-1), span_G=np.minimum(N - first, K))


def _allowed(runs: _Runs, limit: float | None) -> np.ndarray:
    """[G, K] the run times a memory limit allows (inf: no such run, no cost, or over the limit)."""
    ok = np.isfinite(runs.t_GK) & (np.arange(1, runs.t_GK.shape[1] + 1)[None, :] <= runs.span_G[:, None])
    if limit is not None:
        assert runs.mem_GK is not None
        ok &= runs.mem_GK <= limit
    return np.where(ok, runs.t_GK, np.inf)


@dataclass(frozen=True)
class _Ends:
    """The runs by where they end: E[n - 1, k - 1] is the allowed time (`_allowed`) of the run of k samples that
    ends at sorted index n (inf where k > n). A limit c allows no run ending at n longer than the number of
    entries <= c in S[n - 1] (E's suffix minimum along k), and every run up to the number in P[n - 1] (E's prefix
    maximum): both non-decreasing, so `np.searchsorted` counts them."""

    E: np.ndarray
    S: np.ndarray
    P: np.ndarray


def _ends(tt_GK: np.ndarray, grp: np.ndarray) -> _Ends:
    """`_Ends` of the allowed times (`_allowed`) of the samples' length groups `grp`."""
    N, K = grp.size, tt_GK.shape[1]
    by_start = np.full((K + N, K), np.inf)  # row K + i: the runs starting at sorted index i; K rows of none first
    by_start[K:] = tt_GK[grp]
    # E[n - 1, k - 1] = by_start[K + n - k, k - 1]: a sheared view (strides in elements: K per n, 1 - K per k)
    item = by_start.itemsize
    E = np.ascontiguousarray(np.lib.stride_tricks.as_strided(by_start[K:], shape=(N, K),
                                                             strides=(K * item, (1 - K) * item)))
    return _Ends(E=E, S=np.minimum.accumulate(E[:, ::-1], axis=1)[:, ::-1], P=np.maximum.accumulate(E, axis=1))


def _thin(vals: np.ndarray, delta: float) -> np.ndarray:
    """Sorted distinct run times thinned to windows of width delta, each represented by its upper end."""
    if delta <= 0 or vals.size == 0:
        return vals
    after = np.searchsorted(vals, vals + delta, side="right").tolist()  # one past the window opened at each
    keep = []
    i = 0
    while i < vals.size:
        i = after[i]
        keep.append(i - 1)
    return vals[keep]


DP_STEP_S = 20e-6
"""Cost model of `_dp`, for `_blocks` to group the limits by (measured on CPU-AVX2): the fixed cost of one vector
step (one prefix end, one block of limits), of each (limit, run) pair in it, and the extra of each pair some
limit of the block may not allow (masked)."""
DP_PAIR_S = 1.5e-9
DP_MASKED_S = 2e-9


def _blocks(top_CN: np.ndarray, all_CN: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive limits (ascending; per prefix end, the most runs each may allow, top_CN, and the runs each
    surely allows, all_CN) grouped into blocks [a, b) that run as one vector step per prefix end over the runs
    the block's largest limit may allow, masked where its smallest may not: few blocks pay fewer steps, more
    blocks fewer pairs."""
    C = top_CN.shape[0]
    top = top_CN.sum(axis=1).astype(np.float64)
    every = all_CN.sum(axis=1).astype(np.float64)
    steps = np.count_nonzero(top_CN, axis=1) * DP_STEP_S
    out: list[tuple[int, int]] = []
    for lo in range(0, C, 256):  # the partition DP is quadratic in the limits: 256 at a time
        hi = min(C, lo + 256)
        best = np.zeros(hi - lo + 1)
        cut = np.zeros(hi - lo + 1, dtype=np.int64)
        for j in range(1, hi - lo + 1):
            a = np.arange(j)
            size = j - a
            total = best[:j] + size * ((DP_PAIR_S + DP_MASKED_S) * top[lo + j - 1]
                                       - DP_MASKED_S * every[lo:lo + j]) + steps[lo + j - 1]
            cut[j] = int(np.argmin(total))
            best[j] = total[cut[j]]
        j, part = hi - lo, []
        while j > 0:
            part.append((lo + int(cut[j]), lo + j))
            j = int(cut[j])
        out += part[::-1]
    return out


def _dp(ends: _Ends, tmax: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f[C, N + 1] (least sum of run times with every run <= tmax[c]) and the argmin start of each prefix's last
    run (the shortest of equal ones; meaningful where f is finite). The limits run in blocks (`_blocks`), one
    vector step per prefix end n over the runs ending at n that the block's largest limit may allow."""
    N = ends.E.shape[0]
    C = tmax.shape[0]
    f = np.full((C, N + 1), np.inf)
    f[:, 0] = 0.0
    arg = np.zeros((C, N + 1), dtype=np.int64)
    order = np.argsort(tmax, kind="stable")
    lims = tmax[order]
    top_NC = np.empty((N, C), dtype=np.int64)
    all_NC = np.empty((N, C), dtype=np.int64)
    for n in range(N):
        top_NC[n] = np.searchsorted(ends.S[n], lims, side="right")
        all_NC[n] = np.searchsorted(ends.P[n], lims, side="right")
    for a, b in _blocks(top_NC.T, all_NC.T):
        rows = order[a:b]
        f[rows], arg[rows] = _dp_block(ends.E, lims[a:b], top_NC[:, b - 1], all_NC[:, a])
    return f, arg


def _dp_block(E: np.ndarray, tmax: np.ndarray, top_N: np.ndarray, all_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_dp` for one block of limits: the runs ending at n that any may allow are the last top_N[n - 1] samples',
    and every limit allows the first all_N[n - 1] of them (k ascending: argmin's first minimum is the shortest)."""
    N, C = E.shape[0], tmax.shape[0]
    f = np.full((C, N + 1), np.inf)
    f[:, 0] = 0.0
    last = np.zeros((C, N + 1), dtype=np.int64)  # the last run's samples, less one
    lim = tmax[:, None]
    r = np.arange(C)
    tops, alls = top_N.tolist(), all_N.tolist()
    for n in (np.flatnonzero(top_N) + 1).tolist():
        w, sure = tops[n - 1], alls[n - 1]
        t = E[n - 1, :w]                               # runs [n - k, n), k = 1..w
        val = f[:, n - w:n][:, ::-1] + t
        if sure < w:
            np.putmask(val[:, sure:], t[sure:] > lim, np.inf)
        best = val.argmin(axis=1)
        f[:, n] = val[r, best]
        last[:, n] = best
    arg = np.arange(-1, N)[None, :] - last
    arg[:, 0] = 0
    return f, arg


SEARCH_GRID = 64
"""Candidate limits the search (`_search`) evaluates per round; fewer candidates than twice this are all
evaluated at once."""


def _search(ends: _Ends, cands: np.ndarray, stages: int,
            dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The DP (`_dp`) at the candidate limits that can hold the optimum, found by bounds: (the indices of the
    candidates evaluated, ascending; f[:, N] at them; their argmin rows).

    h(c) = (P - 1) c + f_c / D, with f_c the least sum of run times under limit c, is at least the Eq1 of the
    split found at c (its maximum is at most c), and the smallest h over the candidates is at most the smallest
    Eq1 of any split their DP finds (a split's Eq1 is h at its own maximum's window, up to the thinning). f is
    non-increasing in c, so a candidate c between two evaluated ones has h(c) >= (P - 1) c + f_next / D with
    f_next the sum at the next evaluated candidate above it; candidates whose bound exceeds the least h found
    are never evaluated. The rest are, SEARCH_GRID more per round, until none is left: the least h is then
    the one over every candidate, so the plan's Eq1 is within the thinning bound of the optimum as before (and
    exactly optimal with thin 0), while large batches evaluate a few hundred of their thousands of limits."""
    C, N = cands.size, ends.E.shape[0]
    f_N = np.full(C, np.nan)
    args: dict[int, np.ndarray] = {}

    def evaluate(idx: np.ndarray) -> None:
        f, arg = _dp(ends, cands[idx])
        f_N[idx] = f[:, N]
        for j, row in zip(idx.tolist(), arg):
            args[j] = row

    if C <= 2 * SEARCH_GRID:
        evaluate(np.arange(C))
    else:
        evaluate(np.unique(np.linspace(0, C - 1, SEARCH_GRID + 1).round().astype(np.int64)))
        while True:
            done = np.flatnonzero(~np.isnan(f_N))
            h = (stages - 1) * cands[done] + f_N[done] / dp
            best = float(np.min(h)) if np.isfinite(h).any() else np.inf
            # each candidate's bound from the next evaluated one above it (the largest is always evaluated)
            nxt = done[np.searchsorted(done, np.arange(C), side="left").clip(max=done.size - 1)]
            bound = (stages - 1) * cands + f_N[nxt] / dp
            todo = np.flatnonzero(np.isnan(f_N) & (bound <= best * (1 + 1e-12)))
            if todo.size == 0:
                break
            evaluate(todo[np.unique(np.linspace(0, todo.size - 1, min(SEARCH_GRID, todo.size)).round()
                                    .astype(np.int64))])
    done = np.flatnonzero(~np.isnan(f_N))
    return done, f_N[done], np.stack([args[j] for j in done.tolist()])


def _split_for_replicas(runs: list[tuple[int, int]], dp: int, R: int, tt_GK: np.ndarray,
                        grp: np.ndarray) -> list[tuple[int, int]]:
    """`runs` with its longest run halved until there are `dp` (one per data-parallel replica) or no run can
    be halved into two of at least R samples (R: the lockstep ranks, a row each) that fit the table. The DP's
    Eq1 counts a replica's share of the runs, so one run for two replicas is its "optimum" on a small batch."""
    runs = list(runs)
    while len(runs) < dp:
        cands = [(b - a, j) for j, (a, b) in enumerate(runs) if b - a >= 2 * R]
        if not cands:
            break
        _, j = max(cands)
        a, b = runs[j]
        m = a + (b - a) // 2
        if not (np.isfinite(tt_GK[grp[a], m - a - 1]) and np.isfinite(tt_GK[grp[m], b - m - 1])):
            break
        runs[j:j + 1] = [(a, m), (m, b)]
    return runs


def _pick(idx: np.ndarray, f_N: np.ndarray, arg: np.ndarray, N: int, dp: int, R: int, stages: int,
          tt_GK: np.ndarray, grp: np.ndarray) -> tuple[bool, float, list[tuple[int, int]], int] | None:
    """The best of the candidates' splits by their actual Eq1, in ascending order of the limit (the first of
    equal ones); (whether a split was repaired for the replicas, its Eq1, its runs, the candidates read), or
    None when no candidate has a split."""
    best: tuple[bool, float, list[tuple[int, int]]] | None = None
    repaired = False
    for c in np.flatnonzero(np.isfinite(f_N)):
        runs = _backtrack(arg[c], N)
        if len(runs) < dp:  # every data-parallel replica needs a micro-batch: split the longest runs
            runs, repaired = _split_for_replicas(runs, dp, R, tt_GK, grp), True
        times = [float(tt_GK[grp[i], n - i - 1]) for i, n in runs]
        obj = iteration_objective(times, stages, dp)
        short = len(runs) < dp  # a split that leaves a replica idle loses to any that feeds them all
        if best is None or (short, obj) < (best[0], best[1] - 1e-15 * abs(best[1])):
            best = (short, obj, runs)
    return None if best is None else (repaired, best[1], best[2], int(idx.size))


def _backtrack(arg: np.ndarray, N: int) -> list[tuple[int, int]]:
    runs = []
    n = N
    while n > 0:
        i = int(arg[n])
        runs.append((i, n))
        n = i
    return runs[::-1]


def dp_split(L_desc: np.ndarray, cost: MicroBatchCost, stages: int, *, dp: int = 1, memory: float | None = None,
             thin: float = 0.01, pad_multiple: int = 8) -> SplitResult:
    """The best contiguous split of descending lengths under Eq1: exact when thin == 0 and the best split has at
    least `dp` micro-batches; one with fewer (each replica needs one) is repaired by halving, not re-searched
    (docs/microbatching.md)."""
    if stages < 1 or dp < 1:
        raise ConfigError(f"stages ({stages}) and data-parallel size ({dp}) must be at least 1")
    if thin < 0:
        raise ConfigError(f"thin must be >= 0 (0: exact); got {thin}")
    N, R = len(L_desc), cost.spread
    if N < R:
        raise ConfigError(f"{N} samples cannot give each of the {R} ranks that run micro-batches in lockstep a "
                          f"row: use a larger batch (data.batch_size)")
    table = _run_tables(L_desc, cost, pad_multiple, memory is not None)
    grp = table.grp
    # the shortest run: one sample, or one row per lockstep rank; every sample must fit in one (a run of R
    # sorted samples costs what its longest one does, and every sample is the longest of such a run)
    first = grp[np.minimum(np.arange(N), N - R)]
    if not np.isfinite(table.t_GK[first, R - 1]).all():
        i = int(np.flatnonzero(~np.isfinite(table.t_GK[first, R - 1]))[0])
        raise ConfigError(f"a sample of length {int(L_desc[i])} has no cost: "
                          f"{cost.explain_infeasible(R, int(_pad(L_desc[i], pad_multiple)))}")
    modes = [("per-1f1b", memory / stages), ("single", memory)] if memory is not None else [("none", None)]
    for mode, limit in modes:
        tt = _allowed(table, limit)
        if not np.isfinite(tt[first, R - 1]).all():
            continue
        t_first = tt[grp[0]][np.isfinite(tt[grp[0]])]
        lb = (stages - 1 + 1.0 / dp) * float(t_first.min())
        delta = thin * lb / (stages - 1) if stages > 1 else 0.0
        exact = np.unique(tt[np.isfinite(tt)])
        if exact.size == 0:
            continue
        cands = exact[-1:] if stages == 1 else _thin(exact, delta)
        ends = _ends(tt, grp)
        # Prune by an upper bound: the unconstrained split's Eq1 (UB >= OPT). The optimum's maximum m* has
        # (P - 1) m* <= UB, and its window representative is <= m* + delta, so larger limits never win.
        f1, arg1 = _dp(ends, exact[-1:])
        if np.isfinite(f1[0, N]):
            runs1 = _backtrack(arg1[0], N)
            ub = iteration_objective([float(tt[grp[i], n - i - 1]) for i, n in runs1], stages, dp)
            if stages > 1:
                cands = cands[(stages - 1) * cands <= ub + (stages - 1) * delta * (1 + 1e-12) + 1e-300]
        picked = _pick(*_search(ends, cands, stages, dp), N, dp, R, stages, tt, grp)
        if picked is not None and picked[0] and picked[3] < cands.size:  # a repaired split: the bounds speak of
            # the DP's own splits, so every limit is evaluated
            f, arg = _dp(ends, cands)
            picked = _pick(np.arange(cands.size), f[:, N], arg, N, dp, R, stages, tt, grp)
        if picked is None:
            continue
        _, obj, runs, evaluated = picked
        return SplitResult(runs=tuple(runs), times=tuple(float(tt[grp[i], n - i - 1]) for i, n in runs),
                           objective=obj, candidates=int(cands.size), candidates_exact=int(exact.size), delta=delta,
                           memory_limit=limit, memory_mode=mode, evaluated=evaluated)
    if memory is None:  # every sample fits, yet no split into runs of R to K rows exists
        raise ConfigError(f"{N} samples cannot be split into micro-batches of {R} to {table.t_GK.shape[1]} rows (each "
                          f"of the {R} ranks that run micro-batches in lockstep takes at most {int(cost.b_grid[-1])} "
                          f"rows of the cost table): profile a larger token cap (pipeline.dynamic.max_tokens)")
    assert table.mem_GK is not None
    need = table.mem_GK[first, R - 1]
    worst = int(np.argmax(need))
    raise ConfigError(f"a sample of length {int(L_desc[worst])} needs {need[worst]:.4g} bytes of "
                      f"activations on "
                      f"its largest stage, more than the memory budget {memory:.4g}: raise the budget, use "
                      f"more stages or cut long samples")


# ---------------------------------------------------------------------------------------------------------
# data parallelism: Karmarkar-Karp


def karmarkar_karp(values: Sequence[float], k: int) -> list[list[int]]:
    """Largest differencing method for k-way number partitioning: the indices of `values` per part (parts
    in decreasing order of their sums). Deterministic: ties are broken by insertion order."""
    if k < 1:
        raise ConfigError(f"karmarkar_karp needs k >= 1; got {k}")
    vals = [float(v) for v in values]
    if k == 1:
        return [list(range(len(vals)))]
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for n, v in enumerate(vals):
        sums = [v] + [0.0] * (k - 1)
        parts: list[list[int]] = [[n]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-v, n, sums, parts))
    tick = len(vals)
    while len(heap) > 1:
        _, _, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        # a is sorted descending; pair its largest with b's smallest
        ob = sorted(range(k), key=lambda q: (sb[q], q))
        sums = [sa[q] + sb[ob[q]] for q in range(k)]
        parts = [pa[q] + pb[ob[q]] for q in range(k)]
        order = sorted(range(k), key=lambda q: (-sums[q], q))
        sums, parts = [sums[q] for q in order], [parts[q] for q in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tick, sums, parts))
        tick += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(p) for p in heap[0][3]]


# ---------------------------------------------------------------------------------------------------------
# baselines: padding to the batch maximum, packing, token budget


def split_padding(lengths: np.ndarray, num_micro: int) -> list[list[int]]:
    """Megatron-style: the batch in its given order, cut into num_micro equal row counts (sizes differ by at
    most one); every micro-batch is padded to the *batch's* longest sample."""
    N = len(lengths)
    m = max(1, min(num_micro, N))
    return [list(map(int, part)) for part in np.array_split(np.arange(N), m)]


def split_packing(lengths: np.ndarray, max_len: int) -> list[list[int]]:
    """Rows of at most max_len tokens, filled first-fit in the given order (no sample is cut: every sample
    is at most max_len long)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths.tolist()):
        for r in range(len(rows)):
            if room[r] >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_len - n)
    return rows


def split_tokens(L_desc: np.ndarray, budget: int, pad_multiple: int = 8) -> list[tuple[int, int]]:
    """Token-based micro-batching (TB in §8.4): sorted runs whose padded tokens stay within a budget."""
    runs, i, N = [], 0, len(L_desc)
    while i < N:
        s = int(_pad(L_desc[i], pad_multiple))
        k = max(1, budget // s)
        runs.append((i, min(N, i + k)))
        i = min(N, i + k)
    return runs


# ---------------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class MicroBatch:
    """Rows of sample indices (one sample per row, several when packed), padded to `seq` tokens."""

    rows: tuple[tuple[int, ...], ...]
    seq: int
    tokens: int
    """Real tokens (sum of the samples' lengths)."""
    time_s: float
    """Predicted bottleneck-stage forward + backward seconds."""
    memory: float
    """Predicted stored activation bytes on its largest stage."""

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def samples(self) -> list[int]:
        return [i for row in self.rows for i in row]

    def part(self, index: int, parts: int) -> tuple[tuple[int, ...], ...]:
        """The rows lockstep rank `index` of `parts` runs: every parts-th row from its index (rows come sorted
        by length, so each rank gets long and short ones; the plan gives every rank at least one)."""
        return self.rows[index::parts]


@dataclass(frozen=True)
class ReplicaPlan:
    """One data-parallel pipeline's share: its micro-batches (global ids) in injection order, the schedule,
    and every stage's instruction stream (micro-batch numbers are positions in `micro_batches`)."""

    micro_batches: tuple[int, ...]
    schedule: str
    streams: tuple[tuple[tuple[str, int], ...], ...]
    makespan_s: float
    peak_memory: tuple[float, ...]
    candidates: tuple[tuple[str, float, bool], ...] = ()


@dataclass(frozen=True)
class MicroBatchPlan:
    """One iteration's micro-batching: what every rank of every pipeline needs to run it."""

    method: str
    stages: int
    micro_batches: tuple[MicroBatch, ...]
    replicas: tuple[ReplicaPlan, ...]
    objective_s: float
    """Eq1 of the split (before scheduling)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    lockstep: int = 1
    """Ranks that split each micro-batch's rows (`MicroBatch.part`) and run the replica's schedule together."""

    @property
    def real_tokens(self) -> int:
        return sum(m.tokens for m in self.micro_batches)

    @property
    def computed_tokens(self) -> int:
        return sum(m.size * m.seq for m in self.micro_batches)

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / max(self.computed_tokens, 1)

    @property
    def predicted_time_s(self) -> float:
        """Simulated iteration time: the slowest replica's pipeline."""
        return max(r.makespan_s for r in self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "stages": self.stages, "objective_s": self.objective_s,
                "padding_efficiency": round(self.padding_efficiency, 6), "predicted_time_s": self.predicted_time_s,
                "real_tokens": self.real_tokens, "computed_tokens": self.computed_tokens,
                "micro_batches": [{"rows": [list(r) for r in m.rows], "seq": m.seq, "tokens": m.tokens,
                                   "time_s": m.time_s, "memory": m.memory} for m in self.micro_batches],
                "replicas": [{"micro_batches": list(r.micro_batches), "schedule": r.schedule,
                              "makespan_s": r.makespan_s, "peak_memory": list(r.peak_memory),
                              "candidates": [list(c) for c in r.candidates],
                              "streams": [[list(i) for i in s] for s in r.streams]} for r in self.replicas],
                "lockstep": self.lockstep, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MicroBatchPlan:
        mbs = tuple(MicroBatch(rows=tuple(tuple(int(i) for i in r) for r in m["rows"]), seq=int(m["seq"]),
                               tokens=int(m["tokens"]), time_s=float(m["time_s"]), memory=float(m["memory"]))
                    for m in d["micro_batches"])
        reps = tuple(ReplicaPlan(micro_batches=tuple(int(x) for x in r["micro_batches"]), schedule=r["schedule"],
                                 streams=tuple(tuple((str(op), int(j)) for op, j in s) for s in r["streams"]),
                                 makespan_s=float(r["makespan_s"]), peak_memory=tuple(r["peak_memory"]),
                                 candidates=tuple((str(a), float(b), bool(c)) for a, b, c in r["candidates"]))
                     for r in d["replicas"])
        return cls(method=d["method"], stages=int(d["stages"]), micro_batches=mbs, replicas=reps,
                   objective_s=float(d["objective_s"]), meta=dict(d.get("meta", {})),
                   lockstep=int(d.get("lockstep", 1)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> MicroBatchPlan:
        return cls.from_dict(json.loads(text))


def _micros(parts: Sequence[tuple[list[list[int]], int]], lengths: np.ndarray,
            cost: MicroBatchCost) -> list[MicroBatch]:
    """Micro-batches of (rows, padded length) pairs, costed in one vector query; the first without a cost is an
    error naming its shape."""
    b = np.asarray([len(rows) for rows, _ in parts], dtype=np.int64)
    seq = np.asarray([s for _, s in parts], dtype=np.int64)
    t, mem = cost.time(b, seq), cost.memory(b, seq)
    if not np.isfinite(t).all():
        j = int(np.flatnonzero(~np.isfinite(t))[0])
        rows_j, seq_j = int(b[j]), int(seq[j])
        raise ConfigError(f"a micro-batch of {rows_j} rows x {seq_j} tokens has no cost: "
                          f"{cost.explain_infeasible(rows_j, seq_j)}")
    return [MicroBatch(rows=tuple(tuple(int(i) for i in r) for r in rows), seq=int(s),
                       tokens=int(sum(int(lengths[i]) for r in rows for i in r)), time_s=float(t[j]),
                       memory=float(mem[j])) for j, (rows, s) in enumerate(parts)]


def _counts(n: int, cost: MicroBatchCost) -> list[int]:
    """Micro-batch counts a baseline's search tries: n / r for every profiled row count r (powers of two), and 1
    (the whole batch, which no r gives when n is not a power of two: where lockstep ranks split every
    micro-batch's rows it may be the only count that gives each a row)."""
    return sorted({-(-n // int(r)) for r in cost.rows_grid} | {n, 1})


def _best_count(make: Any, counts: Sequence[int], stages: int, dp: int, memory: float | None) -> list[MicroBatch]:
    """Baselines' micro-batch count, searched on the cost model (the paper grid-searches the baseline's
    micro-batch size and reports its best): the count with the least Eq1 that fits the memory limit, among the
    counts that give each of the dp replicas a micro-batch where one does (Eq1 counts a replica's 1/dp share, so
    on a small batch one micro-batch for all replicas is its "optimum", and a replica would have nothing to run;
    `_split_for_replicas` is the dynamic method's counterpart)."""
    best: tuple[bool, float, list[MicroBatch]] | None = None
    why = ""  # the last count's reason to fail, for the error
    for m in counts:
        try:
            mbs = make(m)
        except ConfigError as e:
            why = f": {m} micro-batches: {e}"
            continue
        if memory is not None and max(x.memory for x in mbs) > memory / stages:
            continue
        key = (len(mbs) < dp, iteration_objective([x.time_s for x in mbs], stages, dp))
        if best is None or key < best[:2]:
            best = (*key, mbs)
    if best is None:
        raise ConfigError(f"no micro-batch count of the baseline fits the cost table and the memory budget{why}")
    return best[2]


def plan_microbatches(lengths: Sequence[Any], cost: MicroBatchCost, *, method: str = "dynamic", dp: int = 1,
                      memory: float | None = None, max_len: int | None = None, pad_multiple: int = 8,
                      thin: float = 0.01, schedules: Sequence[str] = DYN_SCHEDULES, num_micro: int | None = None,
                      token_budget: int | None = None, clusters: int | None = None,
                      comm_s: float = 0.0, lockstep: int = 1) -> MicroBatchPlan:
    """The micro-batching of one mini-batch (sample i has length lengths[i]) on `cost.stages` stages x dp.

    lockstep: ranks of each replica that split every micro-batch's rows and run its schedule together (expert
    shards, or every rank of a stage when MoE layers sum routing statistics over it): a micro-batch is costed
    by its busiest rank's rows and has at least one row per rank (`MicroBatchCost.spread_over`).

    method: 'dynamic' (DynaPipe), 'padding' (batch order, padded to the batch's longest, num_micro
    micro-batches, or the best count by the cost model), 'packing' (first-fit rows of max_len tokens,
    rows grouped into num_micro micro-batches or the best count), 'tokens' (sorted, a token budget per
    micro-batch). Baselines run 1F1B in their given order; 'dynamic' simulates `schedules`.
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ConfigError(f"unknown micro-batching method {method!r}; choose one of {', '.join(METHODS)}")
    if pad_multiple < 1:
        raise ConfigError(f"pad_multiple must be at least 1; got {pad_multiple}")
    if lockstep < 1:
        raise ConfigError(f"lockstep must be at least 1 rank; got {lockstep}")
    cost = cost.spread_over(lockstep)
    P = cost.stages
    cap = max_len if max_len is not None else cost.max_len
    L = check_lengths(lengths, cap)
    meta: dict[str, Any] = {"samples": int(L.size), "dp": dp, "pad_multiple": pad_multiple}
    if method == "dynamic":
        order = np.argsort(-L, kind="stable")
        split = dp_split(L[order], cost, P, dp=dp, memory=memory, thin=thin, pad_multiple=pad_multiple)
        mbs = _micros([([[int(order[i])] for i in range(a, b)], int(_pad(L[order[a]], pad_multiple)))
                       for a, b in split.runs], L, cost)
        meta.update(candidates=split.candidates, candidates_exact=split.candidates_exact,
                    candidates_evaluated=split.evaluated, delta_s=split.delta,
                    memory_mode=split.memory_mode, memory_limit=split.memory_limit, thin=thin)
    elif method == "padding":
        seq = int(_pad(L.max(), pad_multiple))
        mbs = _best_count(lambda m: _micros([([[i] for i in part], seq) for part in split_padding(L, m)], L, cost),
                          [num_micro] if num_micro else _counts(L.size, cost), P, dp, memory)
    elif method == "packing":
        rows = split_packing(L, cap)
        mbs = _best_count(lambda m: _micros([([rows[r] for r in part], cap)
                                             for part in np.array_split(np.arange(len(rows)), min(m, len(rows)))],
                                            L, cost),
                          [num_micro] if num_micro else _counts(len(rows), cost), P, dp, memory)
    else:
        order = np.argsort(-L, kind="stable")

        def by_budget(budget: int) -> list[MicroBatch]:
            return _micros([([[int(order[i])] for i in range(a, b)], int(_pad(L[order[a]], pad_multiple)))
                            for a, b in split_tokens(L[order], budget, pad_multiple)], L, cost)

        budgets = [token_budget] if token_budget else sorted({int(b * s) for b in cost.rows_grid for s in cost.s_grid
                                                              if s >= L.max()})
        mbs = _best_count(by_budget, budgets, P, dp, memory)
    objective = iteration_objective([m.time_s for m in mbs], P, dp)
    if dp > 1:
        parts = karmarkar_karp([m.time_s for m in mbs], dp) if method == "dynamic" else \
            [list(map(int, x)) for x in np.array_split(np.arange(len(mbs)), dp)]
        if any(not p for p in parts):
            raise ConfigError(f"{len(mbs)} micro-batches cannot feed {dp} data-parallel pipelines: every replica "
                              f"needs one (use a larger batch or fewer replicas)")
    else:
        parts = [list(range(len(mbs)))]
    replicas = tuple(_schedule_replica(mbs, part, cost, memory, schedules if method == "dynamic" else ("1f1b",),
                                       method == "dynamic", clusters, comm_s) for part in parts)
    meta["plan_s"] = time.perf_counter() - t0
    return MicroBatchPlan(method=method, stages=P, micro_batches=tuple(mbs), replicas=replicas,
                          objective_s=objective, meta=meta, lockstep=lockstep)


def _schedule_replica(mbs: list[MicroBatch], ids: list[int], cost: MicroBatchCost, memory: float | None,
                      schedules: Sequence[str], search: bool, clusters: int | None, comm_s: float) -> ReplicaPlan:
    rows = np.asarray([mbs[i].size for i in ids])
    seqs = np.asarray([mbs[i].seq for i in ids])
    f, b = cost.stage_times(rows, seqs)
    act = cost.stage_memory(rows, seqs)
    if search:
        choice = choose_schedule(f, b, act, memory, schedules, comm_s, clusters)
        order, name, tl, cands = list(choice.order), choice.name, choice.timeline, choice.candidates
    else:
        order, name = list(range(len(ids))), "1f1b"
        tl = simulate(one_f_one_b(cost.stages, order), f, b, comm_s, act)
        cands = (("1f1b", tl.makespan, memory is None or max(tl.peak_P) <= memory),)
    # renumber: micro-batch k of this replica is the k-th injected
    pos = {j: k for k, j in enumerate(order)}
    ops = [(p, kind, pos[j], s, e) for p, kind, j, s, e in tl.ops]
    streams = build_comm_plan(ops, cost.stages)
    proof = check_plan(streams)  # every plan proves its order before any rank runs it
    assert proof, f"planner bug: the communication plan does not pass the deadlock checker: {proof.reason}"
    return ReplicaPlan(micro_batches=tuple(ids[j] for j in order), schedule=name,
                       streams=tuple(tuple(s) for s in streams), makespan_s=tl.makespan, peak_memory=tl.peak_P,
                       candidates=cands)
