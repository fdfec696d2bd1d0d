"""Expert placement planners: Pro-Prophet's locality greedy search and the baselines, plus placement metrics.

Shape legend: R = ranks in the expert-parallel group (the paper's D), E = logical experts.
`counts_RE[d, e]` = token-expert assignments rank d routes to expert e (the all-gathered gating result).

Every policy is a pure, deterministic function of (counts, costs, owner map, options): each rank runs it on
the same all-gathered counts and reaches the same plan without a broadcast. `predicted_time` is always the
Pro-Prophet model (eq. 6, or eq. 8 with overlap=True) of the returned plan, so policies compare on one scale.

Settled gaps and bugs of the paper (arXiv 2411.10003) and of its released code (see docs/planner.md):
- Loop "until imbalanced" is read as WHILE imbalanced (eq. 7); eq. 7 divides by the mean RANK load I/R
  (the code's world size; the paper's I/E when E = D). Default alpha = 0: the search runs to its natural
  end (at most E steps) and the best prefix decides, which is never worse under the model than stopping
  early; alpha > 0 only trades plan quality for planner time (the code uses 3).
- The returned plan is the best PREFIX of the greedy sequence (argmin, as the paper), not the code's
  improvement counter. Ties keep the shorter prefix (strict <).
- Trans/Agg are costed with the true number of selected experts (the code always costs s = 1).
- ReplaceInputs is exact: tokens of an excluded rank stay with the owner (the code gives every rank its
  own tokens and approximates the receive counts).
- n: each selected expert excludes its `n` lowest-count non-owner ranks (default 0) and, with exclude_zero
  (default), every rank that routes no token to it (Fig. 6: E0 is not sent to the device without E0
  inputs). A zero-token replica costs Trans and Agg and saves nothing, so this dominates the code's global
  n = min(#zero-sending sources, 1). The owner is never counted among the n (the code's BottomK could pick
  it, which broadcast the expert to everyone). Ties: the lower rank id is excluded first.
- More than one expert per rank: the heaviest rank (lowest id on ties) offers its not-yet-replicated
  expert that takes the most tokens off it (then lowest id); when it has none left the search stops (the
  paper's `Used` rule, per expert instead of per device).
- Memory (the extraction's gap 14: the paper does not bound the number of replicas): `max_replicas` caps the
  replicas one rank receives per layer, under every replicating policy. Pro-Prophet sends a selected expert
  only to the included ranks still below the cap (its token deltas then computed for those ranks); an expert
  no rank can take is passed over. FasterMoE's shadows and broadcast_topk's experts go, in their priority
  order, to each rank until it holds the cap. None: no cap (every expert a rank does not own, at most).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.perf import (
    PAPER_COSTS,
    FasterMoECosts,
    MoELayerCosts,
    ReplicaLoads,
    a2a_loads,
    ep_loads,
    evaluate,
    evaluate_held,
    fastermoe_expert_loads,
    fastermoe_shadow,
    layer_time,
    linked_times,
    placement_loads,
    replicas_from_held,
)
from moebal.planner.plan import ExpertPlacement

__all__ = ["POLICIES", "DEFAULT_COSTS", "plan_experts", "check_counts", "prophet_search",
           "placement_metrics", "ExpertPlanner"]

POLICIES = ("prophet", "fastermoe", "static", "broadcast_topk")

DEFAULT_COSTS: MoELayerCosts = PAPER_COSTS
"""Used when no costs are given: the authors' RTX 3090 + 100 Gb/s IB constants for MoE-GPT-M (fp32)."""

_OPTIONS: dict[str, dict[str, Any]] = {
    "prophet": {"alpha": 0.0, "n": 0, "exclude_zero": True, "overlap": False, "max_replicas": None},
    "fastermoe": {"overlap": False, "fastermoe_costs": None, "max_replicas": None},
    "static": {"overlap": False, "max_replicas": None},
    "broadcast_topk": {"k": 2, "overlap": False, "max_replicas": None},
}


# ---- input checks --------------------------------------------------------------------------------------------
def check_counts(counts_RE: Any, owner: Sequence[int] | None = None, cost: MoELayerCosts | None = None,
                 shape: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(counts_RE as float64, owner_E as int64) or a ConfigError saying what is wrong and how to fix it.

    shape: the (ranks, experts) the caller was built for, if any."""
    try:
        c_RE = np.asarray(counts_RE, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"routing counts must be a rectangular R x E matrix of numbers (ranks x experts) on the "
                          f"host; got a ragged or non-numeric {type(counts_RE).__name__} (a device tensor: .cpu())"
                          ) from None
    if c_RE.ndim != 2 or c_RE.shape[0] < 1 or c_RE.shape[1] < 1:
        raise ConfigError(f"routing counts must be a 2-D R x E matrix (ranks x experts); got shape {c_RE.shape}")
    R, E = c_RE.shape
    if shape is not None and tuple(shape) != (R, E):
        raise ConfigError(f"routing counts are {R} x {E} (ranks x experts) but this was built for "
                          f"{shape[0]} ranks x {shape[1]} experts")
    if not np.isfinite(c_RE).all():
        raise ConfigError("routing counts contain NaN or infinity; they must be finite token counts")
    if (c_RE < 0).any():
        d, e = np.argwhere(c_RE < 0)[0]
        raise ConfigError(f"routing counts must be >= 0; counts[{d}][{e}] = {c_RE[d, e]:g}")
    if cost is not None and cost.num_ranks is not None and cost.num_ranks != R:
        raise ConfigError(f"the counts have {R} rows (ranks) but the costs are for num_ranks={cost.num_ranks}")
    if owner is None:
        if E % R:
            raise ConfigError(f"{E} experts cannot be sharded evenly over {R} ranks: give an owner map "
                              f"(owner[e] = rank) or an expert-parallel size that divides the experts")
        return c_RE, np.arange(E, dtype=np.int64) // (E // R)
    owner_E = np.asarray(owner)
    if owner_E.shape != (E,) or owner_E.dtype.kind not in "iu":
        raise ConfigError(f"owner map must list one integer rank per expert ({E}); got {list(owner)!r}")
    if E and (owner_E.min() < 0 or owner_E.max() >= R):
        raise ConfigError(f"owner map ranks must be in 0..{R - 1}; got {list(owner)!r}")
    return c_RE, owner_E.astype(np.int64)


def _options(policy: str, options: dict[str, Any]) -> dict[str, Any]:
    if policy not in _OPTIONS:
        raise ConfigError(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    unknown = sorted(set(options) - set(_OPTIONS[policy]))
    if unknown:
        raise ConfigError(f"policy {policy!r} takes no option(s) {unknown}; valid: {sorted(_OPTIONS[policy])}")
    return {**_OPTIONS[policy], **options}


# ---- the planners --------------------------------------------------------------------------------------------
def plan_experts(counts_RE: Any, policy: str = "prophet", cost: MoELayerCosts | None = None,
                 owner: Sequence[int] | None = None, **options: Any) -> ExpertPlacement:
    """Plan one MoE layer's placement from a (predicted) R x E count matrix.

    Options: prophet: alpha (eq. 7, default 0), n (int, or a sequence searched for the best), exclude_zero,
    overlap (eq. 8 instead of eq. 6); fastermoe: overlap, fastermoe_costs (a FasterMoECosts; default from
    `cost`); broadcast_topk: k (default 2), overlap; static: overlap. Every policy: max_replicas (the most
    replicas a rank receives; None: no cap).
    """
    opts = _options(policy, options)
    given = opts["max_replicas"]
    if given is not None and not (isinstance(given, (int, np.integer)) and not isinstance(given, bool) and given >= 0):
        raise ConfigError(f"max_replicas = {given!r} must be an integer >= 0 (replicas a rank receives per layer) "
                          f"or None")
    cap = opts["max_replicas"] = None if given is None else int(given)
    costs = DEFAULT_COSTS if cost is None else cost
    c_RE, owner_E = check_counts(counts_RE, owner, costs)
    R, E = c_RE.shape
    meta: dict[str, Any] = {}
    if policy == "prophet":
        held_RE, meta = _plan_prophet(c_RE, owner_E, costs, opts)
    elif policy == "fastermoe":
        held_RE, meta = _plan_fastermoe(c_RE, owner_E, costs, opts["fastermoe_costs"], cap)
    elif policy == "broadcast_topk":
        k = opts["k"]
        if not (isinstance(k, (int, np.integer)) and k >= 0):
            raise ConfigError(f"broadcast_topk: k = {k!r} must be an integer >= 0")
        hot = np.lexsort((np.arange(E), -c_RE.sum(axis=0)))[:k]  # ties: lower expert id
        held_RE = _broadcast(hot, owner_E, R, cap)
    else:
        held_RE = _broadcast(np.zeros(0, dtype=np.int64), owner_E, R, cap)
    t = evaluate_held(c_RE, held_RE, owner_E, costs, overlap=bool(opts["overlap"])).total_s
    return ExpertPlacement(num_ranks=R, owner=tuple(owner_E.tolist()), replicas=replicas_from_held(held_RE, owner_E),
                           policy=policy, predicted_time=t, meta=meta)


def _broadcast(selected: np.ndarray, owner_E: np.ndarray, R: int, cap: int | None = None) -> np.ndarray:
    """held_RE with each selected expert (ids in priority order) on every rank (FasterMoE shadowing, top-k
    broadcast); with `cap`, a rank receives the first `cap` of them it does not own."""
    E = owner_E.shape[0]
    held_RE = np.zeros((R, E), dtype=bool)
    held_RE[:, selected] = True
    held_RE[owner_E, np.arange(E)] = True
    if cap is not None:
        received_RS = held_RE[:, selected] & (owner_E[selected][None, :] != np.arange(R)[:, None])
        over_RS = np.cumsum(received_RS, axis=1) > cap  # past the cap in priority order
        held_RE[:, selected] &= ~(received_RS & over_RS)
    return held_RE


def _plan_fastermoe(c_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts,
                    fc: FasterMoECosts | None, cap: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    if fc is None:
        _, recv_R = ep_loads(c_RE, owner_E)
        fc = FasterMoECosts.from_layer_costs(costs, float(recv_R.max()) * costs.token_bytes)
    loads_E = fastermoe_expert_loads(c_RE)
    shadow_E, latency = fastermoe_shadow(loads_E, fc)
    E = shadow_E.shape[0]
    order = [int(e) for e in np.lexsort((np.arange(E), -np.asarray(loads_E, dtype=np.float64))) if shadow_E[e]]
    return _broadcast(np.asarray(order, dtype=np.int64), owner_E, c_RE.shape[0], cap), \
        {"fastermoe_latency_s": latency}


def _plan_prophet(c_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts,
                  opts: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    ns = opts["n"]
    ns = [ns] if isinstance(ns, (int, np.integer)) else list(ns)
    if not ns or any(not isinstance(n, (int, np.integer)) or n < 0 for n in ns):
        raise ConfigError(f"prophet: n = {opts['n']!r} must be an integer >= 0 or a list of them")
    alpha = opts["alpha"]
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise ConfigError(f"prophet: alpha = {alpha!r} must be a finite number >= 0 (eq. 7)")
    best: tuple[float, np.ndarray, dict[str, Any]] | None = None
    for n in ns:  # ties keep the first listed n
        t, held_RE, info = prophet_search(c_RE, owner_E, costs, alpha=float(alpha), n=int(n),
                                          exclude_zero=bool(opts["exclude_zero"]), overlap=bool(opts["overlap"]),
                                          max_replicas=opts["max_replicas"])
        if best is None or t < best[0]:
            best = (t, held_RE, {**info, "n": int(n)})
    assert best is not None
    return best[1], best[2]


def _receivers(c_RE: np.ndarray, owner_E: np.ndarray, n: int, exclude_zero: bool) -> np.ndarray:
    """include_RE[d, e]: rank d would get a replica of e if e is selected (never the owner)."""
    R, E = c_RE.shape
    cols_E = np.arange(E)
    include_RE = c_RE > 0 if exclude_zero else np.ones((R, E), dtype=bool)
    include_RE[owner_E, cols_E] = False
    if n > 0:
        key_RE = c_RE.copy()
        key_RE[owner_E, cols_E] = np.inf  # the owner is never one of the n excluded ranks
        lowest_NE = np.argsort(key_RE, axis=0, kind="stable")[: min(n, R - 1)]  # ties: lower rank first
        include_RE[lowest_NE, cols_E] = False
    return include_RE


def prophet_search(c_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts, *, alpha: float = 0.0,
                   n: int = 0, exclude_zero: bool = True, overlap: bool = False,
                   max_replicas: int | None = None) -> tuple[float, np.ndarray, dict[str, Any]]:
    """Algorithm 1 (locality greedy search) on validated inputs: (best time, held_RE of the plan, info).

    Selecting expert e moves every included rank's tokens for e off the owner, independently of the other
    selections, so each step is an O(R) update of H and R by precomputed per-expert deltas. With
    `max_replicas`, e goes only to the included ranks still below the cap, and its deltas are those ranks'.
    """
    R, E = c_RE.shape
    H_R, recv_R = ep_loads(c_RE, owner_E)
    include_RE = _receivers(c_RE, owner_E, n, exclude_zero)
    dH_ER = np.ascontiguousarray((c_RE * include_RE).T)  # tokens each replica holder computes itself
    moved_E = dH_ER.sum(axis=1)
    holders_arr = include_RE.sum(axis=0) + 1  # D - n_e of eq. 4
    holders_E = holders_arr.tolist()
    # Candidates per rank: its experts with at least one replica holder, most tokens moved first.
    order = np.lexsort((np.arange(E), -moved_E, owner_E))
    order = order[holders_arr[order] > 1]
    cands = order.tolist()
    bounds = np.searchsorted(owner_E[order], np.arange(R + 1)).tolist()
    next_cand = bounds[:-1]
    threshold = alpha * float(c_RE.sum()) / R  # eq. 7 on the mean rank load
    i = int(H_R.argmax())  # heaviest rank, lowest id on ties
    # with the group's links, the exchanges' (and without overlap Trans/Agg's) link loads follow each selection
    # (perf.A2ALoads, perf.ReplicaLoads; perf.linked_times says why not Trans/Agg under overlap); else eq. 1-8
    a2a = rep = None
    if costs.links is not None:
        a2a = a2a_loads(c_RE, owner_E[None, :] == np.arange(R)[:, None], owner_E, costs)
        rep = None if overlap else ReplicaLoads(costs.links, costs.expert_param_bytes, costs.expert_grad_bytes)

    def linked(holders: int) -> tuple[float, float, float] | None:
        return None if a2a is None else linked_times(costs, a2a, rep, holders, R)

    base = best = layer_time(costs, float(recv_R.max()), float(H_R[i]), 0, R, overlap, linked(0))
    chosen: list[int] = []
    sent: list[np.ndarray] = []  # with a cap: the ranks each chosen expert goes to
    taken_R = np.zeros(R, dtype=np.int64)  # replicas each rank has received
    best_len, holders = 0, 0
    while threshold <= 0 or float(H_R[i] - H_R.min()) >= threshold:  # eq. 7: run while imbalanced
        if next_cand[i] >= bounds[i + 1]:
            break  # its experts are all replicated already: the paper's `Used` rule
        e = cands[next_cand[i]]
        next_cand[i] += 1
        if max_replicas is None:
            dH_R, moved, holders_e, to_R = dH_ER[e], moved_E[e], holders_E[e], include_RE[:, e]
        else:
            to_R = include_RE[:, e] & (taken_R < max_replicas)
            if not to_R.any():
                continue  # every rank that would take it is full: passed over
            taken_R += to_R
            sent.append(to_R)
            dH_R = c_RE[:, e] * to_R
            moved, holders_e = float(dH_R.sum()), int(to_R.sum()) + 1
        chosen.append(e)
        H_R += dH_R
        H_R[i] -= moved
        recv_R[i] -= moved
        if a2a is not None:
            a2a.move(i, dH_R)
        if rep is not None:
            rep.add(i, to_R)
        holders += holders_e
        i = int(H_R.argmax())
        t = layer_time(costs, float(recv_R.max()), float(H_R[i]), holders, R, overlap, linked(holders))
        if t < best:  # the paper's cnt = s: keep the best prefix, not a count of improvements
            best, best_len = t, len(chosen)
    if max_replicas is None:
        selected_E = np.zeros(E, dtype=bool)
        selected_E[chosen[:best_len]] = True
        held_RE = include_RE & selected_E[None, :]
    else:
        held_RE = np.zeros((R, E), dtype=bool)
        for e, to_R in zip(chosen[:best_len], sent[:best_len]):
            held_RE[:, e] = to_R
    held_RE[owner_E, np.arange(E)] = True
    return best, held_RE, {"steps": len(chosen), "selected": best_len, "static_time_s": base}


# ---- metrics ------------------------------------------------------------------------------------------------
def placement_metrics(counts_RE: Any, placement: ExpertPlacement, cost: MoELayerCosts | None = None,
                      overlap: bool = False) -> dict[str, float]:
    """Rank loads before (plain EP) and after `placement`, the paper's balance degree and RB ratio, the bytes
    of the layer's 4 A2As, Trans and Agg, and the predicted times of both.

    Balance degree BD = population std of the per-rank computed loads H (the paper's "std of the input
    distribution"; per-expert counts do not change under a placement, so H is what can change).
    RB = BD_before / BD_after (inf when the plan balances the load exactly).
    """
    costs = DEFAULT_COSTS if cost is None else cost
    c_RE, owner_E = check_counts(counts_RE, placement.owner, costs,
                                 shape=(placement.num_ranks, placement.num_experts))
    H0_R, recv0_R = ep_loads(c_RE, owner_E)
    H1_R, recv1_R = placement_loads(c_RE, placement)
    mean = float(H0_R.mean())
    bd0, bd1 = float(H0_R.std()), float(H1_R.std())
    rb = bd0 / bd1 if bd1 > 1e-12 * max(mean, 1.0) else (1.0 if bd0 <= 1e-12 * max(mean, 1.0) else math.inf)
    static = ExpertPlacement.static(placement.num_experts, placement.num_ranks, placement.owner)
    return {
        "load_max_before": float(H0_R.max()), "load_max_after": float(H1_R.max()), "load_mean": mean,
        "imbalance_before": float(H0_R.max()) / mean if mean else 1.0,
        "imbalance_after": float(H1_R.max()) / mean if mean else 1.0,
        "balance_degree_before": bd0, "balance_degree_after": bd1, "rb": rb,
        "a2a_bytes_static": 4 * float(recv0_R.sum()) * costs.token_bytes,
        "a2a_bytes": 4 * float(recv1_R.sum()) * costs.token_bytes,
        "trans_bytes": placement.num_replicas * costs.expert_param_bytes,
        "agg_bytes": placement.num_replicas * costs.expert_grad_bytes,
        "replicas": placement.num_replicas,
        "static_time_s": evaluate(c_RE, static, costs, overlap).total_s,
        "predicted_time_s": evaluate(c_RE, placement, costs, overlap).total_s,
    }


# ---- the training-loop helper --------------------------------------------------------------------------------
class ExpertPlanner:
    """Plans iteration j+1 of one MoE layer from iteration j's counts (Pro-Prophet's locality).

    every: re-plan every F observed iterations and keep the plan in between (the paper leaves F open).
    ema: forecast = ema * forecast + (1 - ema) * counts; None or 0 is the paper's "last iteration".
    Before the first observation the plan is plain EP (there is no history to predict from).

    Switching: Trans of every replica is paid again each iteration (replicas are scratch copies refreshed
    after each optimizer step), and the model already charges it to every candidate plan, so moving replicas
    costs no extra communication. A new plan is adopted when its gain over the current plan, both costed on
    the same forecast over the next `every` iterations, exceeds switch_cost_s (a fixed charge per change: buffer
    re-allocation, executor bookkeeping; default 0) plus hysteresis * the current plan's time over the
    interval (guards against flip-flopping between near-equal plans under noisy forecasts; default 0).
    """

    def __init__(self, num_experts: int, num_ranks: int, policy: str = "prophet",
                 cost: MoELayerCosts | None = None, owner: Sequence[int] | None = None, *, every: int = 1,
                 ema: float | None = None, switch_cost_s: float = 0.0, hysteresis: float = 0.0,
                 **options: Any) -> None:
        if not (isinstance(every, int) and every >= 1):
            raise ConfigError(f"ExpertPlanner: every = {every!r} must be an integer >= 1")
        if ema is not None and not 0.0 <= ema < 1.0:
            raise ConfigError(f"ExpertPlanner: ema = {ema!r} must be in [0, 1) (or None: last iteration only)")
        if switch_cost_s < 0 or hysteresis < 0:
            raise ConfigError("ExpertPlanner: switch_cost_s and hysteresis must be >= 0")
        _options(policy, options)
        self.policy, self.options, self.every, self.ema = policy, dict(options), every, ema
        self.switch_cost_s, self.hysteresis = switch_cost_s, hysteresis
        self.cost = DEFAULT_COSTS if cost is None else cost
        zeros = np.zeros((num_ranks, num_experts))
        _, owner_E = check_counts(zeros, owner, self.cost)
        self.owner = tuple(owner_E.tolist())
        self.current = ExpertPlacement.static(num_experts, num_ranks, self.owner)
        self.forecast_RE: np.ndarray | None = None
        self.observed = 0
        self.last: dict[str, Any] = {}

    def step(self, counts_RE: Any) -> ExpertPlacement:
        """Observe one iteration's counts and return the placement for the next iteration."""
        c_RE, _ = check_counts(counts_RE, self.owner, self.cost,
                               shape=(self.current.num_ranks, self.current.num_experts))
        w = self.ema or 0.0
        self.forecast_RE = c_RE if self.forecast_RE is None else w * self.forecast_RE + (1.0 - w) * c_RE
        self.observed += 1
        if (self.observed - 1) % self.every:
            self.last = {"replanned": False, "adopted": False, "plan_s": 0.0, "gain_s": 0.0}
            return self.current
        t0 = time.perf_counter()
        new = plan_experts(self.forecast_RE, self.policy, self.cost, self.owner, **self.options)
        plan_s = time.perf_counter() - t0
        overlap = bool(self.options.get("overlap", False))
        t_cur = evaluate(self.forecast_RE, self.current, self.cost, overlap).total_s
        gain = self.every * (t_cur - float(new.predicted_time or 0.0))
        adopt = gain > self.switch_cost_s + self.hysteresis * self.every * t_cur
        self.current = new if adopt else dataclasses.replace(self.current, predicted_time=t_cur)
        self.last = {"replanned": True, "adopted": adopt, "plan_s": plan_s, "gain_s": gain}
        return self.current
