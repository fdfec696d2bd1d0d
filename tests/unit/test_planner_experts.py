"""Expert placement planners: the paper's worked cases, a plain reference of Algorithm 1, properties, baselines,
the training-loop helper, metrics and bad input.

Shape legend: R = ranks, E = experts; counts_RE[d, e] = tokens rank d routes to expert e.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebal.errors import ConfigError
from moebal.planner import ExpertPlanner, MoELayerCosts, placement_metrics, plan_experts
from moebal.planner.perf import FasterMoECosts, evaluate
from moebal.planner.placement import DEFAULT_COSTS
from moebal.planner.plan import ExpertPlacement

UNIT = MoELayerCosts(token_bytes=1, expert_param_bytes=50, expert_grad_bytes=50, expert_tokens_per_s=1,
                     a2a_bandwidth=1, trans_bandwidth=1, agg_bandwidth=1)
M1 = [[40, 5, 5, 10], [30, 10, 10, 10], [30, 10, 10, 10], [20, 15, 15, 10]]
M2 = [[60, 10, 5, 5], [50, 30, 0, 0], [40, 20, 10, 10], [30, 20, 10, 20]]


# ---- the extraction's worked cases (unit costs) ----------------------------------------------------------------
def test_one_step_replicates_the_hot_expert_to_all():
    p = plan_experts(M1, cost=UNIT, alpha=1)
    assert p.replicas == ((1, 2, 3), (), (), ()) and p.predicted_time == 430
    assert p.meta["static_time_s"] == 680 and p.meta["steps"] == 1  # 70 - 40 = 30 < alpha * I / R = 60


def test_excluding_the_lowest_rank_beats_broadcast():
    p = plan_experts(M1, cost=UNIT, alpha=1, n=1)
    assert p.replicas == ((1, 2), (), (), ()) and p.predicted_time == 405
    assert plan_experts(M1, cost=UNIT, alpha=1, n=[0, 1]).predicted_time == 405  # n searched


def test_eq8_hides_the_transfers():
    p = plan_experts(M1, cost=dataclasses.replace(UNIT, nonmoe_fwd_s=30, nonmoe_bwd_s=60), alpha=1, overlap=True)
    assert p.replicas == ((1, 2, 3), (), (), ()) and p.predicted_time == 330


def test_best_prefix_not_last_step():
    # alpha 0.2: four steps costing 430, 560, 690, 580; the plan is the prefix of length 1
    p = plan_experts(M1, cost=UNIT, alpha=0.2)
    assert p.meta["steps"] == 4 and p.meta["selected"] == 1 and p.predicted_time == 430
    assert p.replicated == (0,)


def test_expensive_transfers_give_the_empty_plan():
    p = plan_experts(M1, cost=dataclasses.replace(UNIT, expert_param_bytes=200, expert_grad_bytes=200), alpha=0.2)
    assert p.num_replicas == 0 and p.predicted_time == 680


def test_second_matrix_two_experts():
    p = plan_experts(M2, cost=UNIT, alpha=0.2)
    assert p.replicas == ((1, 2, 3), (0, 2, 3), (), ()) and p.predicted_time == 515  # 1020 -> 690 -> 515
    p = plan_experts(M2, cost=UNIT, alpha=0.2, n=1)
    assert p.replicas == ((1, 2), (2, 3), (), ()) and p.predicted_time == 540  # E0 excl. rank 3, E1 excl. rank 0


def test_code_alpha_three_calls_the_toy_balanced():
    # the released code's alpha = 3: spread 80 < 3 * 60, the loop never starts (why our default is 0)
    p = plan_experts(M1, cost=UNIT, alpha=3)
    assert p.num_replicas == 0 and p.meta["steps"] == 0


def test_balance_degree_and_rb():
    m = placement_metrics(M1, plan_experts(M1, cost=UNIT, alpha=1), UNIT)
    assert m["balance_degree_before"] == pytest.approx(34.64, abs=0.01)
    assert m["balance_degree_after"] == pytest.approx(12.25, abs=0.01)
    assert m["rb"] == pytest.approx(2.83, abs=0.01)
    assert (m["load_max_before"], m["load_max_after"], m["load_mean"]) == (120, 70, 60)
    assert m["a2a_bytes_static"] == 4 * 170 and m["a2a_bytes"] == 4 * 90  # tokens crossing ranks, 4 A2As
    assert m["trans_bytes"] == m["agg_bytes"] == 3 * 50
    assert (m["static_time_s"], m["predicted_time_s"]) == (680, 430)


def test_fig6_no_replica_where_there_are_no_tokens():
    # Fig. 6: E0 (5 inputs) goes from Dev0 only to Dev1, because Dev2 routes nothing to E0.
    c = [[3, 1, 0], [2, 0, 1], [0, 1, 1]]
    cheap = dataclasses.replace(UNIT, expert_param_bytes=0.5, expert_grad_bytes=0.5)
    p = plan_experts(c, cost=cheap)
    assert p.replicas[0] == (1,)
    assert plan_experts(c, cost=cheap, exclude_zero=False).replicas[0] == (1, 2)
    assert p.predicted_time < plan_experts(c, "static", cost=cheap).predicted_time


# ---- a plain reference of Algorithm 1 --------------------------------------------------------------------------
def _reference(c, owner, costs, alpha, n, exclude_zero, overlap, max_replicas=None):
    """Algorithm 1 written plainly: loads recomputed from scratch for every prefix. With `max_replicas`, a
    selected expert goes to its receivers still below the cap, and one none of them can take is passed over."""
    c = np.asarray(c, dtype=float)
    R, E = c.shape
    sent: dict[int, tuple[int, ...]] = {}
    taken = [0] * R

    def capped(e):
        return tuple(r for r in receivers(e) if max_replicas is None or taken[r] < max_replicas)

    def receivers(e):
        others = sorted((r for r in range(R) if r != owner[e]), key=lambda r: (c[r, e], r))
        excluded = set(others[:n]) | ({r for r in others if c[r, e] == 0} if exclude_zero else set())
        return tuple(r for r in range(R) if r != owner[e] and r not in excluded)

    def plan(sel):
        reps = tuple(sent[e] if e in sel else () for e in range(E))
        return ExpertPlacement(num_ranks=R, owner=tuple(owner), replicas=reps)

    def loads(sel):
        H = [0.0] * R
        p = plan(sel)
        for d in range(R):
            for e in range(E):
                H[p.compute_rank(d, e)] += c[d, e]
        return H

    best, best_sel, sel = evaluate(c, plan([]), costs, overlap).total_s, [], []
    while True:
        H = loads(sel)
        if alpha > 0 and max(H) - min(H) < alpha * c.sum() / R:
            break
        i = H.index(max(H))
        cands = [e for e in range(E) if owner[e] == i and e not in sel and capped(e)]
        if not cands:
            break
        e = max(cands, key=lambda e: (sum(c[r, e] for r in receivers(e)), -e))
        sent[e] = capped(e)
        for r in sent[e]:
            taken[r] += 1
        sel.append(e)
        t = evaluate(c, plan(sel), costs, overlap).total_s
        if t < best:
            best, best_sel = t, list(sel)
    return plan(best_sel), best, len(sel)


@st.composite
def problems(draw):
    R = draw(st.integers(1, 5))
    E = R * draw(st.integers(1, 3))
    hot = draw(st.lists(st.integers(1, 8), min_size=E, max_size=E))  # per-expert skew
    c = [[draw(st.integers(0, 12)) * hot[e] for e in range(E)] for _ in range(R)]
    owner = draw(st.one_of(st.none(), st.lists(st.integers(0, R - 1), min_size=E, max_size=E)))
    costs = dataclasses.replace(UNIT, expert_param_bytes=draw(st.sampled_from([0, 1, 10, 50, 200, 1000])),
                                expert_grad_bytes=draw(st.sampled_from([0, 10, 50])),
                                nonmoe_fwd_s=draw(st.sampled_from([0, 30])),
                                nonmoe_bwd_s=draw(st.sampled_from([0, 60])))
    opts = {"alpha": draw(st.sampled_from([0.0, 0.2, 1.0, 3.0])), "n": draw(st.integers(0, 2)),
            "exclude_zero": draw(st.booleans()), "overlap": draw(st.booleans()),
            "max_replicas": draw(st.sampled_from([None, None, 0, 1, 2]))}
    return c, owner, costs, opts


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_reference_and_never_worse_than_no_replication(problem):
    c, owner, costs, opts = problem
    R, E = len(c), len(c[0])
    p = plan_experts(c, "prophet", costs, owner, **opts)
    own = owner if owner is not None else [e // (E // R) for e in range(E)]
    ref_plan, ref_time, ref_steps = _reference(c, own, costs, **opts)
    assert p.replicas == ref_plan.replicas
    assert p.predicted_time == pytest.approx(ref_time, rel=1e-12)
    assert p.meta["steps"] == ref_steps <= E  # at most E greedy steps
    cap = opts["max_replicas"]
    for policy in ("prophet", "fastermoe", "broadcast_topk"):  # no rank receives more than the cap
        q = p if policy == "prophet" else plan_experts(c, policy, costs, owner, max_replicas=cap)
        received = [sum(d in q.replicas[e] for e in range(E)) for d in range(R)]
        assert cap is None or max(received) <= cap, (policy, received)
    static = plan_experts(c, "static", costs, owner, overlap=opts["overlap"])
    if cap == 0:
        assert p.replicas == static.replicas
    assert p.predicted_time <= static.predicted_time
    assert p.predicted_time == evaluate(np.asarray(c), p, costs, opts["overlap"]).total_s
    assert plan_experts(c, "prophet", costs, owner, **opts) == p  # same input, same plan


def test_identical_plans_whatever_the_input_container():
    rng = np.random.default_rng(1)
    c = rng.integers(0, 50, size=(8, 16)) * rng.integers(1, 6, size=16)
    cheap = dataclasses.replace(UNIT, expert_param_bytes=20, expert_grad_bytes=20)
    plans = {plan_experts(x, cost=cheap) for x in (c, c.astype(np.int32), c.astype(float), c.tolist())}
    assert len(plans) == 1 and next(iter(plans)).num_replicas > 0


def test_ties_break_to_the_lowest_id():
    # Swapping ranks 1 <-> 2 together with experts 1 <-> 2 maps this matrix onto itself, so ranks 1 and 2 tie
    # and either choice is as good: the rule (lowest rank id) must pick rank 1's expert E1, every time.
    c = [[7, 0, 0, 6], [4, 2, 1, 1], [4, 1, 2, 1], [0, 4, 4, 3]]
    cheap = dataclasses.replace(UNIT, expert_param_bytes=1, expert_grad_bytes=1)
    p = plan_experts(c, cost=cheap)
    assert p.replicas == ((1, 2), (2, 3), (), (0, 1, 2)) and p.predicted_time == 64
    assert all(plan_experts(np.array(c), cost=cheap) == p for _ in range(3))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.randoms(use_true_random=False))
def test_rank_permutation_permutes_the_plan(R, rnd):
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    c = rng.random((R, R)) * rng.integers(1, 20, size=R)  # continuous counts: no ties
    cheap = dataclasses.replace(UNIT, expert_param_bytes=rng.random() * 5, expert_grad_bytes=rng.random() * 5)
    perm = rng.permutation(R)
    inv = np.argsort(perm)
    p = plan_experts(c, cost=cheap)
    # relabel rank r as inv[r]; expert e keeps its id but its owner becomes inv[e]
    q = plan_experts(c[perm], cost=cheap, owner=inv.tolist())
    assert q.predicted_time == pytest.approx(p.predicted_time, rel=1e-9)
    assert [tuple(sorted(perm[list(r)].tolist())) for r in q.replicas] == [tuple(r) for r in p.replicas]


def test_several_experts_per_rank_picks_the_expert_that_moves_most():
    # 2 ranks x 4 experts (owner [0, 0, 1, 1]); rank 0 computes 10 + 6 + 30 + 2 = 48, rank 1 only 9
    c = [[10, 30, 3, 1], [6, 2, 4, 1]]
    cheap = dataclasses.replace(UNIT, expert_param_bytes=1, expert_grad_bytes=1)
    p = plan_experts(c, cost=cheap)
    # E0 moves rank 1's 6 tokens, E1 only 2: E0 first; afterwards rank 0 (42) is still heaviest -> E1
    assert p.replicas == ((1,), (1,), (), ())
    assert p.meta["steps"] == 2  # rank 0 then has no expert left: the `Used` rule stops the search


def test_owner_map_and_default_costs():
    c = np.array([[50, 1, 1, 1], [40, 1, 1, 1]])
    p = plan_experts(c, owner=[1, 0, 0, 1])  # default costs: the call works and costs the plan in seconds
    assert p.owner == (1, 0, 0, 1) and 0 < p.predicted_time < 1
    assert p.predicted_time == evaluate(c, p, DEFAULT_COSTS).total_s


# ---- baselines ---------------------------------------------------------------------------------------------------
def test_fastermoe_policy_hand_computed():
    # FasterMoE on M2 with t_comp = t_feat = 1 and t_model = 50: loads 180, 80, 35 (E3), 25 (E2);
    # latency 1260 -> 610 -> 345 -> 325: E0, E1 and E3 shadowed to every rank.
    p = plan_experts(M2, "fastermoe", UNIT)
    assert p.replicas == ((1, 2, 3), (0, 2, 3), (), (0, 1, 2))
    assert p.meta["fastermoe_latency_s"] == 325
    # costed on Pro-Prophet's model like every policy: H = [75, 80, 95, 70], R = [0, 0, 15, 0], holders 12
    assert p.predicted_time == 4 * 15 + 3 * 95 + 2 * 150
    fc = FasterMoECosts(t_comp=1, t_feat=1, t_model=1000)
    assert plan_experts(M2, "fastermoe", UNIT, fastermoe_costs=fc).num_replicas == 0


def test_fastermoe_fixed_axis_finds_the_hot_expert_with_many_experts_per_rank():
    # every source sends 20 tokens, so the buggy per-source totals are all equal; expert 5 is the hot one
    c = np.zeros((4, 8))
    c[:, 5] = 14
    c[:, [0, 1, 2, 3, 4, 6, 7]] = 6 / 7
    fc = FasterMoECosts(t_comp=1, t_feat=0, t_model=1)
    assert plan_experts(c, "fastermoe", UNIT, fastermoe_costs=fc).replicated == (5,)


def test_broadcast_topk_and_static():
    p = plan_experts(M2, "broadcast_topk", UNIT, k=2)
    assert p.replicas == ((1, 2, 3), (0, 2, 3), (), ())
    assert plan_experts(M2, "broadcast_topk", UNIT, k=0).num_replicas == 0
    assert plan_experts(M2, "broadcast_topk", UNIT, k=99).num_replicas == 12
    ties = plan_experts([[5, 5, 5, 5]] * 4, "broadcast_topk", UNIT, k=1)
    assert ties.replicated == (0,)
    s = plan_experts(M2, "static", UNIT)
    assert s.num_replicas == 0 and s.predicted_time == 1020 and s.policy == "static"
    # max_replicas 1: each rank receives the hottest of the two it does not own (rank 0 owns E0: it gets E1)
    assert plan_experts(M2, "broadcast_topk", UNIT, k=2, max_replicas=1).replicas == ((1, 2, 3), (0,), (), ())
    with pytest.raises(ConfigError, match="max_replicas = -1 must be an integer >= 0"):
        plan_experts(M2, "prophet", UNIT, max_replicas=-1)


# ---- the training-loop helper ------------------------------------------------------------------------------------
def test_planner_plans_the_next_iteration_from_this_one():
    pl = ExpertPlanner(4, 4, cost=UNIT, alpha=1)
    assert pl.current.num_replicas == 0  # no history: plain EP
    nxt = pl.step(M1)
    assert nxt.replicas == ((1, 2, 3), (), (), ()) and pl.last["adopted"] and pl.last["gain_s"] == 250


def test_planner_every_f_iterations():
    pl = ExpertPlanner(4, 4, cost=UNIT, every=3)
    first = pl.step(M1)
    assert pl.step(M2) is first and not pl.last["replanned"]
    assert pl.step(M2) is first
    assert pl.step(M2).replicas == plan_experts(M2, cost=UNIT).replicas and pl.last["replanned"]


def test_planner_ema_forecast():
    pl = ExpertPlanner(4, 4, cost=UNIT, ema=0.5)
    pl.step(M1)
    pl.step(M2)
    np.testing.assert_allclose(pl.forecast_RE, 0.5 * np.array(M1) + 0.5 * np.array(M2))


def test_planner_switches_only_when_the_gain_pays():
    pl = ExpertPlanner(4, 4, cost=UNIT, switch_cost_s=300)
    kept = pl.step(M1)  # gain 680 - 430 = 250 < 300: keep plain EP, re-costed on the forecast
    assert kept.num_replicas == 0 and kept.predicted_time == 680 and not pl.last["adopted"]
    pl = ExpertPlanner(4, 4, cost=UNIT, switch_cost_s=300, every=2)  # 2 iterations x 250 > 300
    assert pl.step(M1).num_replicas == 3
    pl = ExpertPlanner(4, 4, cost=UNIT, hysteresis=0.5)  # 250 < 0.5 * 680
    assert pl.step(M1).num_replicas == 0


def test_planner_bad_input():
    with pytest.raises(ConfigError, match="every"):
        ExpertPlanner(4, 4, every=0)
    with pytest.raises(ConfigError, match="ema"):
        ExpertPlanner(4, 4, ema=1.0)
    with pytest.raises(ConfigError, match="cannot be sharded"):
        ExpertPlanner(6, 4)
    with pytest.raises(ConfigError, match="takes no option"):
        ExpertPlanner(4, 4, k=2)
    with pytest.raises(ConfigError, match="built for 4 ranks x 4 experts"):
        ExpertPlanner(4, 4).step([[1, 2], [3, 4]])


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts, match", [
    ([1, 2, 3], "2-D"),
    ([[[1]]], "2-D"),
    ([[1, 2], [3]], "rectangular"),
    ([[1, -2], [3, 4]], r"counts\[0\]\[1\] = -2"),
    ([[1, float("nan")], [3, 4]], "NaN"),
    ([["a", "b"], ["c", "d"]], "rectangular"),
    ([[1, 2, 3]] * 2, "3 experts cannot be sharded evenly over 2 ranks"),
])
def test_bad_counts(counts, match):
    with pytest.raises(ConfigError, match=match):
        plan_experts(counts)


def test_bad_options_and_owner():
    with pytest.raises(ConfigError, match="unknown placement policy 'prophit'"):
        plan_experts(M1, "prophit")
    with pytest.raises(ConfigError, match=r"takes no option\(s\) \['k'\]"):
        plan_experts(M1, "prophet", k=2)
    with pytest.raises(ConfigError, match="alpha"):
        plan_experts(M1, alpha=-1)
    with pytest.raises(ConfigError, match="n = -1"):
        plan_experts(M1, n=-1)
    with pytest.raises(ConfigError, match="k = -1"):
        plan_experts(M1, "broadcast_topk", k=-1)
    with pytest.raises(ConfigError, match="owner map must list one integer rank per expert"):
        plan_experts(M1, owner=[0, 1])
    with pytest.raises(ConfigError, match=r"in 0\.\.3"):
        plan_experts(M1, owner=[0, 1, 2, 4])
    with pytest.raises(ConfigError, match="num_ranks=8"):
        plan_experts(M1, cost=dataclasses.replace(UNIT, num_ranks=8))
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        plan_experts([[1, 2, 3]] * 2)
    with pytest.raises(ConfigError, match="built for 2 ranks x 2 experts"):
        placement_metrics(M1, ExpertPlacement.static(2, 2), UNIT)
