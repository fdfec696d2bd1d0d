"""DynaPipe micro-batching, pure parts: cost table, DP split, thinning bound, memory limits, Karmarkar-Karp,
schedules over variable micro-batches, the communication plan and its deadlock checker, bad lengths."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from moebal.errors import ConfigError
from moebal.planner.adaptive_schedule import adaptive, choose_schedule, cluster_orders, one_f_one_b, simulate
from moebal.planner.instructions import build_comm_plan, check_plan, naive_plan
from moebal.planner.microbatch import (
    MicroBatchPlan,
    check_lengths,
    dp_split,
    iteration_objective,
    karmarkar_karp,
    plan_microbatches,
)
from moebal.planner.microbatch_cost import MicroBatchCost, analytic_table, default_grid, load_cost


def quad_table(P: int = 4, max_len: int = 256, max_tokens: int = 2048, alpha: float = 0.3, beta: float = 1e-3,
               gamma: float = 2e-6, rng: np.random.Generator | None = None, noise: float = 0.0) -> MicroBatchCost:
    """t = alpha + beta b s + gamma b s^2 per stage (forward a third), memory b s; optional noise."""
    b, s = default_grid(max_len, max_tokens)
    rows, seq = np.meshgrid(b, s, indexing="ij")
    tokens = rows * seq
    t = alpha + beta * tokens + gamma * tokens * seq
    t = np.broadcast_to(t, (P,) + t.shape).copy()
    if rng is not None and noise:
        t *= np.exp(noise * rng.standard_normal(t.shape))
    beyond = tokens > max_tokens
    t[:, beyond] = np.nan
    act = np.broadcast_to(tokens.astype(float), t.shape).copy()
    act[:, beyond] = np.nan
    return MicroBatchCost(b_grid=b, s_grid=s, fwd_PBS=t / 3, bwd_PBS=2 * t / 3, act_PBS=act, source="test")


def brute_force(L_desc: np.ndarray, cost: MicroBatchCost, stages: int, dp: int, limit: float | None) -> float:
    """Eq1 minimised over every contiguous partition of the sorted order (2^(N-1) of them)."""
    N = len(L_desc)
    s = -(-L_desc // 8) * 8
    best = math.inf
    for cuts in itertools.product([False, True], repeat=N - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [N]
        times = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            t = float(cost.time(b - a, s[a]))
            if not math.isfinite(t) or (limit is not None and float(cost.memory(b - a, s[a])) > limit):
                break
            times.append(t)
        else:
            best = min(best, iteration_objective(times, stages, dp))
    return best


# ---- cost table ----
def test_cost_table_interpolates_and_says_infeasible(tmp_path):
    c = quad_table(P=2, max_len=128, max_tokens=512)
    f, b = c.stage_times(4, 64)
    assert f[0] == pytest.approx((0.3 + 1e-3 * 256 + 2e-6 * 256 * 64) / 3)  # a grid point: exact
    mid = c.time(3, 48)  # bilinear between (2, 32), (4, 32), (2, 64), (4, 64)
    corners = [float(c.time(bb, ss)) for bb in (2, 4) for ss in (32, 64)]
    assert mid == pytest.approx(np.mean(corners))
    assert c.time(5, 20) > c.time(4, 16)
    assert c.time(1, 3) == c.time(1, 16)  # shorter than the grid: the shortest length's value
    assert math.isinf(c.time(1, 129)) and math.isinf(c.time(64, 16))  # beyond the longest length / most rows
    assert math.isinf(c.time(8, 96))  # a missing corner (8 x 128 > 512 tokens): infeasible
    assert not c.feasible(8, 96) and c.feasible(4, 96)
    assert "longest profiled length 128" in c.explain_infeasible(1, 200)
    c.save(tmp_path / "c.json")
    d = load_cost(tmp_path / "c.json")
    assert np.array_equal(np.isnan(d.fwd_PBS), np.isnan(c.fwd_PBS)) and float(d.time(3, 48)) == float(mid)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_cost(tmp_path / "bad.json")


def test_analytic_table_grows_superlinearly_in_length():
    from moebal.planner.cost import ModelShape

    shape = ModelShape(dim=1024, n_layers=4, n_heads=16, n_kv_heads=16, head_dim=64, ffn_dim=4096, vocab_size=32000)
    b, s = default_grid(4096, 16384)
    c = analytic_table(shape, "a100", [2, 2], b, s)
    t1, t4 = float(c.time(1, 1024)), float(c.time(1, 4096))
    assert t4 > float(c.time(4, 1024)) * 1.1  # the same tokens in longer rows: attention is quadratic
    assert float(c.time(4, 1024)) < 4 * t1  # 4 rows share the fixed costs
    assert c.stage_times(1, 1024)[0][1] > c.stage_times(1, 1024)[0][0]  # the head is on the last stage


# ---- the DP ----
def _dp_against_brute_force(rng: np.random.Generator, trials: int, max_stages: int,
                            memory_per_stage: tuple[float, float], lockstep: bool = False
                            ) -> list[tuple[int, int, Any]]:
    """Random small instances (a lockstep group of 2-3 ranks when `lockstep`): the DP's objective equals brute
    force's, and where the DP finds no split neither does brute force; (ranks, samples, result) of the feasible."""
    feasible = []
    for trial in range(trials):
        R = int(rng.integers(2, 4)) if lockstep else 1
        cost = quad_table(P=2, rng=rng, noise=0.3, max_len=256, max_tokens=1024)
        cost = cost.spread_over(R) if lockstep else cost
        N = int(rng.integers(1, 10))
        L = np.sort(rng.integers(1, 257, N))[::-1]
        stages, dp = int(rng.integers(1, max_stages)), int(rng.integers(1, 3))
        memory = None if trial % 3 == 0 else float(rng.uniform(*memory_per_stage)) * stages
        try:
            res = dp_split(L, cost, stages, dp=dp, memory=memory, thin=0.0)
        except ConfigError:
            assert math.isinf(brute_force(L, cost, stages, dp, memory))  # brute force finds no split either
            continue
        assert res.objective == pytest.approx(brute_force(L, cost, stages, dp, res.memory_limit), rel=1e-12)
        feasible.append((R, N, res))
    return feasible


def test_dp_equals_brute_force_on_small_instances():
    for _, N, res in _dp_against_brute_force(np.random.default_rng(0), 40, 6, (300, 3000)):
        assert [a for a, _ in res.runs] == [0] + [b for _, b in res.runs[:-1]] and res.runs[-1][1] == N


def test_every_data_parallel_replica_gets_a_micro_batch():
    # equal short samples: one micro-batch of all of them minimises Eq1 (its time counts 1/dp), which left a
    # replica nothing to run (a dp 2 pipeline failed at its first plan); the split is halved until each has one
    cost = quad_table(P=2, max_len=64, max_tokens=1024, alpha=1.0)
    L = np.full(8, 31)
    assert len(dp_split(L, cost, 2, dp=1).runs) == 1
    for dp in (2, 4):
        plan = plan_microbatches(L, cost, method="dynamic", dp=dp)
        assert len(plan.replicas) == dp and all(len(r.micro_batches) == 1 for r in plan.replicas)
        assert sorted(i for m in plan.micro_batches for r in m.rows for i in r) == list(range(8))
    lock = plan_microbatches(L, cost, method="dynamic", dp=2, lockstep=2)  # halves keep a row per lockstep rank
    assert all(m.size >= 2 for m in lock.micro_batches) and len(lock.micro_batches) >= 2
    with pytest.raises(ConfigError, match="cannot feed 4 data-parallel pipelines"):
        plan_microbatches(L[:3], cost, method="dynamic", dp=4)
    # the baselines' count search had the same blind spot: its least Eq1 was one micro-batch for every replica
    for method in ("padding", "packing", "tokens"):
        assert len(plan_microbatches(L, cost, method=method, dp=1).micro_batches) == 1, method
        for dp in (2, 4):
            plan = plan_microbatches(L, cost, method=method, dp=dp)
            assert len(plan.replicas) == dp and all(r.micro_batches for r in plan.replicas), (method, dp)
            assert sorted(i for m in plan.micro_batches for r in m.rows for i in r) == list(range(8)), method
        with pytest.raises(ConfigError, match="cannot feed 4 data-parallel pipelines"):
            plan_microbatches(L[:3], cost, method=method, dp=4)


def test_thinning_loses_at_most_its_bound():
    rng = np.random.default_rng(1)
    for _ in range(12):
        cost = quad_table(P=4, rng=rng, noise=0.2, max_len=512, max_tokens=4096)
        L = np.sort(np.clip(rng.lognormal(np.log(60), 1.0, 40), 1, 512).astype(int))[::-1]
        exact = dp_split(L, cost, 4, thin=0.0)
        for thin in (0.02, 0.2):
            res = dp_split(L, cost, 4, thin=thin)
            assert res.candidates <= exact.candidates_exact
            assert res.objective <= exact.objective + 3 * res.delta * (1 + 1e-9)
            assert res.objective <= (1 + thin) * exact.objective * (1 + 1e-12)
    assert dp_split(L, cost, 4, thin=0.2).candidates < exact.candidates_exact  # it does thin


@pytest.mark.parametrize("thin", [0.0, 0.01])
def test_the_bounded_search_keeps_the_plan_of_every_candidate_limit(monkeypatch, thin):
    # `_search` runs the DP at the limits whose bound can beat the best found: against the DP at every limit,
    # the same optimum with thin 0, and within the thinning bound (P - 1) delta with thinning
    import moebal.planner.microbatch as mb

    rng = np.random.default_rng(3)
    for trial in range(4):
        cost = quad_table(P=4, rng=rng, noise=0.1, max_len=512, max_tokens=8192)
        L = np.sort(np.clip(rng.lognormal(np.log(80), 1.0, 160), 1, 512).astype(int))[::-1]
        dp = 1 + trial % 2
        fast = dp_split(L, cost, 4, dp=dp, thin=thin)
        monkeypatch.setattr(mb, "SEARCH_GRID", 10 ** 9)  # every candidate in one round: the plain DP
        full = dp_split(L, cost, 4, dp=dp, thin=thin)
        monkeypatch.undo()
        assert full.evaluated == full.candidates > 2 * mb.SEARCH_GRID
        assert fast.evaluated < full.candidates / 2, (fast.evaluated, full.candidates)
        if thin == 0.0:
            assert fast.objective == pytest.approx(full.objective, rel=1e-12)
        else:
            assert fast.objective <= full.objective + 3 * fast.delta * (1 + 1e-9)


def test_memory_limits_are_respected_and_escalate():
    cost = quad_table(P=4, max_len=256, max_tokens=2048)
    rng = np.random.default_rng(2)
    L = np.clip(rng.lognormal(np.log(50), 1.0, 60), 1, 256).astype(int)
    budget = 4 * 600.0
    plan = plan_microbatches(L, cost, memory=budget)
    assert plan.meta["memory_mode"] == "per-1f1b"
    assert all(m.memory <= budget / 4 for m in plan.micro_batches)
    assert max(plan.replicas[0].peak_memory) <= budget
    # the longest sample (256 tokens, 256 bytes) fits the whole budget but not a quarter: escalate
    plan = plan_microbatches(L, cost, memory=700.0)
    assert plan.meta["memory_mode"] == "single" and all(m.memory <= 700 for m in plan.micro_batches)
    assert max(plan.replicas[0].peak_memory) <= 700.0
    with pytest.raises(ConfigError, match="more than the memory budget"):
        plan_microbatches(L, cost, memory=100.0)


def test_dynamic_beats_padding_on_long_tailed_lengths():
    cost = quad_table(P=4, max_len=2048, max_tokens=16384, gamma=2e-4 / 4096 * 4)
    rng = np.random.default_rng(3)
    L = np.clip(rng.lognormal(np.log(150), 1.1, 100), 1, 2048).astype(int)
    dyn = plan_microbatches(L, cost)
    pad = plan_microbatches(L, cost, method="padding")
    pack = plan_microbatches(L, cost, method="packing")
    tok = plan_microbatches(L, cost, method="tokens")
    assert dyn.padding_efficiency >= 0.9 and pad.padding_efficiency <= 0.4
    assert dyn.objective_s <= tok.objective_s  # the DP is optimal among sorted contiguous splits
    assert dyn.predicted_time_s < pad.predicted_time_s / 1.3 and dyn.predicted_time_s < pack.predicted_time_s
    assert sorted(i for m in dyn.micro_batches for i in m.samples) == list(range(100))
    assert sorted(i for m in pack.micro_batches for i in m.samples) == list(range(100))
    again = MicroBatchPlan.from_json(dyn.to_json())
    assert again.micro_batches == dyn.micro_batches and again.replicas == dyn.replicas


@pytest.mark.parametrize("lengths,match", [([5, 0, 3], "sample 1 has length 0"), ([4, -2], "sample 1 has length -2"),
                                           ([3, 2.5], "not a whole number"), ([10, 300], "longer than the model's "
                                                                              "maximum 256"), ([], "empty")])
def test_bad_lengths_get_clear_errors(lengths, match):
    with pytest.raises(ConfigError, match=match):
        check_lengths(lengths, 256)
    if lengths:
        with pytest.raises(ConfigError, match=match):
            plan_microbatches(lengths, quad_table(max_len=256), max_len=256)


# ---- lockstep ranks (expert shards, or a stage summing routing statistics) ----
def test_a_lockstep_table_costs_the_busiest_rank_and_refuses_an_empty_one():
    cost = quad_table(P=2, max_len=256, max_tokens=1024)
    two = cost.spread_over(2)
    assert float(two.time(4, 64)) == float(cost.time(2, 64))  # 2 rows on each rank
    assert float(two.time(5, 64)) == float(cost.time(3, 64))  # the busiest rank holds 3
    assert math.isinf(two.time(1, 16)) and "each of the 2 ranks" in two.explain_infeasible(1, 16)
    assert int(two.rows_grid[-1]) == 2 * int(cost.b_grid[-1]) and two.spread_over(2) is two


def test_lockstep_dp_equals_brute_force_and_every_run_feeds_every_rank():
    for R, _, res in _dp_against_brute_force(np.random.default_rng(1), 30, 5, (600, 6000), lockstep=True):
        assert all(b - a >= R for a, b in res.runs), (R, res.runs)


@pytest.mark.parametrize("method", ["dynamic", "padding", "packing"])
def test_a_lockstep_plan_gives_every_rank_rows_of_every_micro_batch(method):
    cost = quad_table(P=4, max_len=256, max_tokens=2048)
    L = np.clip(np.random.default_rng(5).lognormal(np.log(40), 0.9, 40), 1, 256).astype(int)
    plan = plan_microbatches(L, cost, method=method, dp=2, lockstep=2, max_len=256)
    assert plan.lockstep == 2 and len(plan.replicas) == 2
    for m in plan.micro_batches:
        parts = [m.part(r, 2) for r in range(2)]
        assert all(parts) and sorted(parts[0] + parts[1]) == sorted(m.rows)  # nobody empty, nothing lost
        assert m.time_s == float(cost.time(-(-m.size // 2), m.seq))  # costed by the busiest rank
    assert sorted(i for m in plan.micro_batches for i in m.samples) == list(range(40))
    assert MicroBatchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ConfigError, match="3 samples cannot give each of the 4 ranks"):
        plan_microbatches([5, 6, 7], cost, lockstep=4)


# ---- data parallelism ----
def test_karmarkar_karp_balances():
    rng = np.random.default_rng(4)
    for _ in range(60):
        n, k = int(rng.integers(1, 9)), int(rng.integers(2, 4))
        v = rng.uniform(0.1, 10.0, n)
        parts = karmarkar_karp(v, k)
        assert sorted(i for p in parts for i in p) == list(range(n)) and len(parts) == k
        sums = sorted(sum(v[i] for i in p) for p in parts)
        best = min(max(np.bincount(a, weights=v, minlength=k)) for a in itertools.product(range(k), repeat=n))
        assert sums[-1] <= (4 / 3) * best + 1e-9  # Graham-type bound of largest differencing
        assert sums[-1] - sums[0] <= v.max() + 1e-9
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]  # the textbook LDM run: 16 / 14
    cost = quad_table(P=2)
    plan = plan_microbatches(np.arange(1, 101), cost, dp=2)
    loads = [sum(plan.micro_batches[j].time_s for j in r.micro_batches) for r in plan.replicas]
    assert max(loads) - min(loads) <= max(m.time_s for m in plan.micro_batches)


# ---- schedules ----
def test_adaptive_schedule_facts():
    for c, m in ((4, 8), (4, 16)):
        f, b, a = np.ones((c, m)), 2 * np.ones((c, m)), np.ones((c, m))
        order = list(range(m))
        assert simulate(adaptive(c, order), f, b).makespan == simulate(one_f_one_b(c, order), f, b).makespan
        assert adaptive(c, order, a, [c - p for p in range(c)]) == one_f_one_b(c, order)
        peaks = simulate(adaptive(c, order), f, b, act_PM=a).peak_P
        assert peaks == tuple(float(min(2 * (c - p) - 1, m)) for p in range(c))
    f, b, a = np.ones((4, 16)), 2 * np.ones((4, 16)), np.ones((4, 16))
    uniform = simulate(adaptive(4, list(range(16)), a, [4] * 4), f, b).makespan
    assert uniform == 66 and simulate(one_f_one_b(4, list(range(16))), f, b).makespan == 57
    choice = choose_schedule(f, b, a, limit=4)  # the chooser keeps 1F1B there
    assert choice.name == "1f1b" and choice.timeline.makespan == 57


def test_adaptive_is_more_robust_to_variable_durations():
    rng = np.random.default_rng(5)
    for c, m in ((4, 16), (8, 32)):
        one, ada = [], []
        for _ in range(40):
            n = np.clip(1 + 0.4 * rng.standard_normal(m), 0.05, None)[None, :].repeat(c, 0)
            one.append(simulate(one_f_one_b(c, list(range(m))), n, 2 * n).makespan)
            ada.append(simulate(adaptive(c, list(range(m))), n, 2 * n).makespan)
        assert np.mean(ada) < np.mean(one)


def test_cluster_orders_are_permutations_of_groups():
    t = [5, 5.1, 1, 1.1, 3, 3.2, 9]
    orders = cluster_orders(t)
    assert orders[0] == list(range(7)) and len(orders) == len({tuple(o) for o in orders}) <= 1 + 24
    assert all(sorted(o) == list(range(7)) for o in orders)
    assert [2, 3, 4, 5, 0, 1, 6] in orders  # groups by duration, ascending


# ---- communication plans ----
def _random_instance(rng: np.random.Generator) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    P, M = int(rng.integers(2, 6)), int(rng.integers(1, 13))
    f = rng.uniform(0.2, 2.0, (P, M)) * rng.uniform(0.5, 1.5, (P, 1))
    return P, M, f, f * rng.uniform(1.5, 2.5, (P, M)), rng.uniform(0.5, 2.0, (P, M))


def test_every_planned_communication_order_is_deadlock_free():
    rng = np.random.default_rng(6)
    for _ in range(150):
        P, M, f, b, a = _random_instance(rng)
        for orders in (one_f_one_b(P, list(rng.permutation(M))),
                       adaptive(P, list(range(M)), a, rng.uniform(1.0, 6.0, P))):
            tl = simulate(orders, f, b, comm_s=float(rng.uniform(0, 0.3)), act_PM=a)
            streams = build_comm_plan(tl.ops, P)
            result = check_plan(streams)
            assert result, result.reason
            # whatever the real durations: the order does not depend on them being right
            f2, b2 = f * rng.lognormal(0, 0.8, f.shape), b * rng.lognormal(0, 0.8, b.shape)
            assert simulate(orders, f2, b2).makespan > 0 and check_plan(streams)


def test_an_unordered_plan_fails_the_checker():
    rng = np.random.default_rng(7)
    for _ in range(40):
        P, M, f, b, a = _random_instance(rng)
        if M < 2:
            continue
        for orders in (one_f_one_b(P, list(range(M))), adaptive(P, list(range(M)))):
            result = check_plan(naive_plan(orders))
            assert not result and "deadlock" in result.reason
    streams = build_comm_plan(simulate(one_f_one_b(2, [0, 1]), np.ones((2, 2)), np.ones((2, 2))).ops, 2)
    broken = [list(s) for s in streams]
    broken[1].remove(("wait_act", 1))
    assert "comes before" in check_plan(broken).reason  # a consumer before its receive is not a plan
    swapped = [list(s) for s in streams]
    i, j = swapped[0].index(("send_act", 0)), swapped[0].index(("send_act", 1))
    swapped[0][i], swapped[0][j] = swapped[0][j], swapped[0][i]
    assert not check_plan(swapped)  # sends posted out of the receivers' order


def test_stage_scale_weighs_each_stages_units_by_their_cost_and_leaves_the_embedding_and_head_alone():
    from moebal.errors import ConfigError
    from moebal.planner.microbatch_cost import stage_scale

    # units of cost 1, 3 | 2, 2 at factors 0.5, 1 | 0.25, 1; embedding 4 on stage 0, head 6 on stage 1
    assert stage_scale([1, 3, 2, 2], [0.5, 1.0, 0.25, 1.0], [2, 2], 4.0, 6.0) == [7.5 / 8, 8.5 / 10]
    assert stage_scale([1, 3, 2, 2], [0.5, 1.0, 0.25, 1.0], [2, 2]) == [0.875, 0.625]
    assert stage_scale([1, 1, 1], [1.0, 1.0, 1.0], [1, 2]) is None  # nothing to scale
    assert stage_scale([1, 1], [1e-9, 1.0], [1, 1]) == [1e-4, 1.0]  # never 0: a table's times stay positive
    with pytest.raises(ConfigError, match="must agree"):
        stage_scale([1, 1, 1], [1.0, 1.0], [1, 2])


def test_a_scaled_table_scales_each_stages_times_and_keeps_its_memory():
    from moebal.errors import ConfigError

    t = quad_table(P=2)
    s = t.scaled([0.5, 2.0])
    f, b = t.stage_times(4, 64)
    fs, bs = s.stage_times(4, 64)
    assert np.allclose(fs, f * np.array([0.5, 2.0])) and np.allclose(bs, b * np.array([0.5, 2.0]))
    assert np.array_equal(s.stage_memory(4, 64), t.stage_memory(4, 64)) and s.meta["scheme_scale"] == [0.5, 2.0]
    assert t.scaled(None) is t and t.scaled([1.0, 1.0]) is t
    with pytest.raises(ConfigError, match="needs 2 positive factors"):
        t.scaled([1.0, 0.0])


def test_a_checkpoints_plan_scale_is_taken_only_for_as_many_stages():
    """A resumed run plans a batch read ahead with the checkpoint's scale of it (`MicrobatchPlanner._scale_of`),
    unless the checkpoint had another number of stages (resumed on another layout): then with its own."""
    from moebal.balance.microbatches import MicrobatchPlanner

    planner = MicrobatchPlanner.__new__(MicrobatchPlanner)  # the two attributes the choice reads
    planner.cost = quad_table(P=2)
    planner.restore_scales({"5": [0.5, 0.9], "6": [0.5, 0.9, 1.0], "7": None})
    current = [0.8, 0.8]
    assert [planner._scale_of(s, current) for s in (5, 6, 7, 8)] == [[0.5, 0.9], current, None, current]
    assert planner._scale_of(5, current) == current  # taken once


def test_a_baseline_s_search_tries_the_whole_batch_as_one_micro_batch():
    """3 samples, 2 ranks splitting every micro-batch's rows (lockstep): only one micro-batch gives each a row,
    and no profiled row count r gives ceil(3 / r) = 1 below 3, so the padding baseline refused a batch that fits."""
    from moebal.planner.microbatch import _counts

    cost = quad_table(P=3, max_len=256, max_tokens=2048)
    assert 1 in _counts(3, cost)
    plan = plan_microbatches(np.array([2, 13, 8]), cost, method="padding", lockstep=2)
    assert [mb.rows for mb in plan.micro_batches] == [((0,), (1,), (2,))]
