"""Pro-Prophet's performance model (eq. 1-8) and FasterMoE's shadowing model, against hand-computed values.

Shape legend: R = ranks, E = experts; counts_RE[d, e] = tokens rank d routes to expert e.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebal.errors import ConfigError
from moebal.planner.perf import (
    PAPER_COSTS,
    FasterMoECosts,
    MoELayerCosts,
    ep_loads,
    evaluate,
    evaluate_held,
    fastermoe_expert_loads,
    fastermoe_shadow,
    held_mask,
    layer_time,
    placement_loads,
    replicas_from_held,
    t_a2a,
    t_agg,
    t_bec,
    t_fec,
    t_trans,
)
from moebal.planner.plan import ExpertPlacement

# The extraction's unit costs: A2A 1 per received token, compute 1 per token, a full Trans = full Agg = 50.
UNIT = MoELayerCosts(token_bytes=1, expert_param_bytes=50, expert_grad_bytes=50, expert_tokens_per_s=1,
                     a2a_bandwidth=1, trans_bandwidth=1, agg_bandwidth=1)
M1 = np.array([[40, 5, 5, 10], [30, 10, 10, 10], [30, 10, 10, 10], [20, 15, 15, 10]])


def test_eq1_to_eq5_hand_values():
    c = MoELayerCosts(token_bytes=2, expert_param_bytes=300, expert_grad_bytes=600, expert_tokens_per_s=10,
                      a2a_bandwidth=4, trans_bandwidth=3, agg_bandwidth=2)
    assert t_a2a(c, 10) == pytest.approx(10 * 2 / 4)                    # eq. 1
    assert t_a2a(c, 0) == 0.0
    assert t_fec(c, 50) == pytest.approx(5.0)                           # eq. 2
    assert t_bec(c, 50) == pytest.approx(10.0)                          # eq. 3: 2 x forward
    s, n, D = 3, 1, 4
    assert t_trans(c, s * (D - n), D) == pytest.approx(s * (D - n) / D * 300 / 3)  # eq. 4 = 225
    assert t_agg(c, s * (D - n), D) == pytest.approx(s * (D - n) / D * 600 / 2)    # eq. 5 = 675
    # eq. 6: 4 A2A + FEC + BEC + Trans + Agg
    assert layer_time(c, 10, 50, 9, 4) == pytest.approx(4 * 5 + 5 + 10 + 225 + 675)


def test_eq8_hides_transfers_under_compute():
    c = dataclasses.replace(UNIT, nonmoe_fwd_s=30, nonmoe_bwd_s=60)
    # Trans 50 vs FEC 70 + FNEC 30: hidden; Agg 50 vs BEC 140 + BNEC 60: hidden (the extraction's 330).
    assert layer_time(c, 30, 70, 4, 4, overlap=True) == pytest.approx(4 * 30 + 3 * 70)
    # Partly hidden: holders 40 -> Trans = Agg = 500; exposed 500 - 10 - 30 = 460 and 500 - 20 - 60 = 420.
    assert layer_time(c, 0, 10, 40, 4, overlap=True) == pytest.approx(30 + 460 + 420)
    assert layer_time(c, 0, 10, 40, 4, overlap=False) == pytest.approx(30 + 500 + 500)
    # 4 micro-batches (overlap_share 1/4): Trans hides under a quarter of FEC + FNEC, Agg of BEC + BNEC
    quarter = dataclasses.replace(c, overlap_share=0.25)
    assert layer_time(quarter, 0, 10, 40, 4, overlap=True) == pytest.approx(30 + (500 - 10) + (500 - 20))
    with pytest.raises(ConfigError, match="overlap_share"):
        dataclasses.replace(c, overlap_share=0.0)


def test_piecewise_and_callable_a2a_bandwidth():
    table = MoELayerCosts(token_bytes=1000, expert_param_bytes=1, expert_grad_bytes=1, expert_tokens_per_s=1,
                          a2a_bandwidth=[[1e4, 1e6], [1e5, 1e7], [None, 1e8]], trans_bandwidth=1, agg_bandwidth=1)
    assert table.a2a_bw(1e4) == 1e6 and table.a2a_bw(1e4 + 1) == 1e7 and table.a2a_bw(1e9) == 1e8
    assert t_a2a(table, 5) == pytest.approx(5e3 / 1e6)   # 5 kB -> first row
    assert t_a2a(table, 50) == pytest.approx(5e4 / 1e7)  # 50 kB -> second row
    capped = dataclasses.replace(table, a2a_bandwidth=((1e4, 1e6),))
    assert capped.a2a_bw(1e9) == 1e6  # beyond the table: its last rate
    lat = dataclasses.replace(table, a2a_bandwidth=lambda b: b / (1e-3 + b / 1e9))
    assert t_a2a(lat, 1000) == pytest.approx(1e-3 + 1e6 / 1e9)


def test_paper_costs_are_the_released_constants():
    assert PAPER_COSTS.token_bytes == 1024 * 4
    assert PAPER_COSTS.expert_param_bytes == 2 * 1024 * 2048 * 4
    assert PAPER_COSTS.a2a_bw(100 * 1024) == pytest.approx(6e9 / 8)
    assert PAPER_COSTS.a2a_bw(2**20 + 1) == pytest.approx(100e9 / 8)
    assert PAPER_COSTS.trans_bandwidth == pytest.approx(15e9 / 8)
    # per-token forward time of the authors' code: 4 * alpha_h * d^2 * 4 / 35.7e12
    assert 1 / PAPER_COSTS.expert_tokens_per_s == pytest.approx(4 * 2 * 1024**2 * 4 / 35.7e12)
    assert PAPER_COSTS.nonmoe_bwd_s == pytest.approx(2 * PAPER_COSTS.nonmoe_fwd_s)


def test_from_shape_swiglu():
    c = MoELayerCosts.from_shape(d_model=64, ffn_dim=128, flops_per_s=1e9, a2a_bandwidth=1e9, trans_bandwidth=2e9,
                                 dtype_bytes=2)
    assert c.token_bytes == 128 and c.expert_param_bytes == 3 * 64 * 128 * 2 == c.expert_grad_bytes
    assert c.expert_tokens_per_s == pytest.approx(1e9 / (6 * 64 * 128))
    assert c.agg_bandwidth == 2e9


def test_costs_roundtrip_and_errors():
    assert MoELayerCosts.from_dict(PAPER_COSTS.to_dict()) == PAPER_COSTS
    with pytest.raises(ConfigError, match="unknown MoELayerCosts field.*tokn_bytes"):
        MoELayerCosts.from_dict({**UNIT.to_dict(), "tokn_bytes": 1})
    with pytest.raises(ConfigError, match="expert_tokens_per_s"):
        dataclasses.replace(UNIT, expert_tokens_per_s=0)
    with pytest.raises(ConfigError, match="token_bytes"):
        dataclasses.replace(UNIT, token_bytes=-1)
    with pytest.raises(ConfigError, match="increasing"):
        dataclasses.replace(UNIT, a2a_bandwidth=[[10, 1], [5, 2]])
    with pytest.raises(ConfigError, match="a2a_bandwidth"):
        dataclasses.replace(UNIT, a2a_bandwidth="fast")
    with pytest.raises(ConfigError, match="callable"):
        dataclasses.replace(UNIT, a2a_bandwidth=lambda b: 1.0).to_dict()


def test_eq6_on_the_extraction_toy_matrix():
    owner_E = np.arange(4)
    H_R, recv_R = ep_loads(M1, owner_E)
    assert H_R.tolist() == [120, 40, 40, 40] and recv_R.tolist() == [80, 30, 30, 30]
    assert evaluate(M1, ExpertPlacement.static(4, 4), UNIT).total_s == 680  # 4 * 80 + 3 * 120
    # E0 to every rank: H = [40, 70, 70, 60], R = [0, 30, 30, 30], Trans = Agg = 50 -> 430
    bcast = ExpertPlacement(num_ranks=4, owner=(0, 1, 2, 3), replicas=((1, 2, 3), (), (), ()))
    lt = evaluate(M1, bcast, UNIT)
    assert (lt.max_compute_tokens, lt.max_recv_tokens, lt.trans_s, lt.total_s) == (70, 30, 50, 430)
    # E0 excluding rank 3: the owner keeps rank 3's 20 tokens; (D - n) / D = 3/4 -> 405
    excl = dataclasses.replace(bcast, replicas=((1, 2), (), (), ()))
    H_R, recv_R = placement_loads(M1, excl)
    assert H_R.tolist() == [60, 70, 70, 40] and recv_R.tolist() == [20, 30, 30, 30]
    assert evaluate(M1, excl, UNIT).total_s == 405
    # eq. 8 with 4 micro-batches: the reference hides Trans and Agg under the same quarter of the compute as the
    # searches' `layer_time` (FEC 70, BEC 140, FNEC 30, BNEC 60: exposed 50 - 25 = 25 and 50 - 50 = 0)
    quarter = dataclasses.replace(UNIT, nonmoe_fwd_s=30, nonmoe_bwd_s=60, overlap_share=0.25)
    lt = evaluate(M1, bcast, quarter, overlap=True)
    assert (lt.exposed_trans_s, lt.exposed_agg_s, lt.total_s) == (25, 0, 4 * 30 + 3 * 70 + 25)
    assert lt.total_s == pytest.approx(layer_time(quarter, 30, 70, lt.holders, 4, overlap=True))


def test_loads_with_several_experts_per_rank():
    # 2 ranks x 4 experts, owner = [0, 0, 1, 1]
    c = np.array([[10, 0, 3, 1], [6, 2, 4, 5]])
    owner_E = np.array([0, 0, 1, 1])
    H_R, recv_R = ep_loads(c, owner_E)
    assert H_R.tolist() == [18, 13] and recv_R.tolist() == [8, 4]  # rank 0 gets 6 + 2, rank 1 gets 3 + 1
    plan = ExpertPlacement(num_ranks=2, owner=(0, 0, 1, 1), replicas=((1,), (), (), ()))
    H_R, recv_R = placement_loads(c, plan)
    assert H_R.tolist() == [12, 19] and recv_R.tolist() == [2, 4]
    assert evaluate(c, plan, UNIT).holders == 2


def _reference_loads(c_RE, plan):
    R, E = c_RE.shape
    H, recv = [0.0] * R, [0.0] * R
    for d in range(R):
        for e in range(E):
            r = plan.compute_rank(d, e)
            H[r] += c_RE[d, e]
            if r != d:
                recv[r] += c_RE[d, e]
    return H, recv


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.data())
def test_placement_loads_match_a_loop_reference(R, per, data):
    E = R * per
    c_RE = np.array(data.draw(st.lists(st.lists(st.integers(0, 30), min_size=E, max_size=E), min_size=R, max_size=R)))
    owner = tuple(data.draw(st.lists(st.integers(0, R - 1), min_size=E, max_size=E)))
    reps = tuple(tuple(sorted(data.draw(st.sets(st.sampled_from([r for r in range(R) if r != o]) if R > 1
                                                else st.nothing())))) for o in owner)
    plan = ExpertPlacement(num_ranks=R, owner=owner, replicas=reps)
    H, recv = placement_loads(c_RE, plan)
    H_ref, recv_ref = _reference_loads(c_RE, plan)
    assert H.tolist() == H_ref and recv.tolist() == recv_ref
    assert replicas_from_held(held_mask(plan), np.array(owner)) == reps
    assert sum(H) == c_RE.sum()


def test_fastermoe_loads_sum_over_sources_not_the_buggy_axis():
    c = np.array([[9, 0, 1, 0], [8, 1, 1, 0]])  # sources send 10 each; expert 0 receives 17
    assert fastermoe_expert_loads(c).tolist() == [17, 1, 2, 0]
    assert c.sum(axis=1).tolist() == [10, 10]  # the released code's axis: per-source totals, nearly equal


def test_fastermoe_shadow_hand_computed():
    fc = FasterMoECosts(t_comp=1.0, t_feat=1.0, t_model=50.0)  # per-token price 3 + 4 = 7
    # sorted loads 180, 80, 35, 25: 7*180 = 1260 -> 7*80 + 50 = 610 -> 7*35 + 100 = 345 -> 7*25 + 150 = 325
    mask, lat = fastermoe_shadow(np.array([180.0, 80, 25, 35]), fc)
    assert mask.tolist() == [True, True, False, True] and lat == 325
    # stops at the first step that does not pay: 7 * (100 - 95) = 35 < 50
    mask, lat = fastermoe_shadow(np.array([100.0, 95, 10]), fc)
    assert mask.tolist() == [False, False, False] and lat == 700
    # the last expert is never shadowed, even when the broadcast is free
    mask, _ = fastermoe_shadow(np.array([5.0, 3, 1]), dataclasses.replace(fc, t_model=0.0))
    assert mask.tolist() == [True, True, False]
    # two experts tied at the top: shadowing one cannot lower the bottleneck, so nothing is shadowed
    mask, lat = fastermoe_shadow(np.array([10.0, 50, 50, 1]), fc)
    assert mask.tolist() == [False, False, False, False] and lat == 350


def test_fastermoe_costs_constructors():
    fc = FasterMoECosts.from_shape(d_model=2048)  # FasterMoE's environment defaults
    assert fc.t_feat == pytest.approx(2048 * 4 / 6.25e9)
    assert fc.t_model == pytest.approx(2 * 2 * 2048**2 * 4 / 6.25e9)
    assert fc.t_comp == pytest.approx(4 * 2 * 2048**2 / 11.5e12)
    lc = FasterMoECosts.from_layer_costs(PAPER_COSTS, a2a_bytes=2**21)
    assert lc.t_feat == pytest.approx(4096 / 12.5e9)
    assert lc.t_model == pytest.approx(PAPER_COSTS.expert_param_bytes / PAPER_COSTS.trans_bandwidth)
    assert math.isclose(lc.latency(10, 2), 10 * (3 * lc.t_comp + 4 * lc.t_feat) + 2 * lc.t_model)


@pytest.mark.parametrize("profile", ["a100", "h100", "rtx3090-nvlink"])
def test_link_priced_exchanges_equal_the_simulators_all_to_all(profile):
    """Costs from a profile price any exchange as `CostModel.all_to_all` (the simulator's), skew included: the
    dispatch's traffic and the combine's reverse one, each latency plus the busiest link."""
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.planner.perf import a2a_loads

    cost = CostModel(profile, "bf16")
    R, E = 8, 16
    shape = ModelShape(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=64, ffn_dim=512, vocab_size=100,
                       num_experts=E, top_k=2, expert_ffn_dim=512)
    costs = cost.moe_layer_costs(shape, list(range(R)), 1024, 1024)
    topo = cost.topology(R)
    rng = np.random.default_rng(0)
    owner = np.arange(E) // 2
    for skew in (0.0, 1.0, 3.0):
        p = np.full(E, 1 / E) if skew == 0 else _zipf(E, skew, rng)
        c_RE = np.stack([rng.multinomial(2048, p) for _ in range(R)]).astype(float)
        held = np.zeros((R, E), bool)
        held[owner, np.arange(E)] = True
        held[rng.integers(0, R, 6), rng.integers(0, E, 6)] = True  # a few replicas
        send = np.zeros((R, R))
        for e in range(E):
            send[:, owner[e]] += c_RE[:, e] * ~held[:, e]
        b = send * costs.token_bytes
        want = 2 * (cost.time_of(cost.all_to_all(topo, range(R), b), topo)
                    + cost.time_of(cost.all_to_all(topo, range(R), b.T), topo))
        assert a2a_loads(c_RE, held, owner, costs).seconds() == pytest.approx(want, rel=1e-12)
        assert evaluate_held(c_RE, held, owner, costs).a2a_s == pytest.approx(want / 4, rel=1e-12)
    nothing = a2a_loads(np.zeros((R, E)), held, owner, costs).seconds()  # an empty exchange pays its latencies
    assert nothing == pytest.approx(4 * cost.time_of(cost.all_to_all(topo, range(R), np.zeros((R, R))), topo))
    assert nothing > 0


def _zipf(E, s, rng):
    p = rng.permutation(1 / np.arange(1, E + 1) ** s)
    return p / p.sum()


def test_the_search_moves_link_loads_as_a_fresh_count_would():
    """prophet_search updates the exchanges' link loads per selection; the plan it returns costs what it said."""
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.planner.placement import plan_experts, prophet_search

    cost = CostModel("a100", "bf16")
    R, E = 8, 8
    shape = ModelShape(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, head_dim=128, ffn_dim=4096, vocab_size=100,
                       num_experts=E, top_k=2, expert_ffn_dim=2048)
    costs = cost.moe_layer_costs(shape, list(range(R)), 16384, 4096)
    rng = np.random.default_rng(1)
    p = _zipf(E, 2.0, rng)
    c_RE = np.stack([rng.multinomial(2 * 16384, p) for _ in range(R)]).astype(float)
    for cap in (None, 1):
        best, held, info = prophet_search(c_RE, np.arange(E), costs, max_replicas=cap)
        assert info["selected"] > 0 and best < info["static_time_s"]
        assert evaluate_held(c_RE, held, np.arange(E), costs).total_s == pytest.approx(best, rel=1e-12)
        pl = plan_experts(c_RE, "prophet", costs, max_replicas=cap)
        assert pl.predicted_time == pytest.approx(best, rel=1e-12)


def test_moving_tokens_off_an_owner_updates_both_exchanges_link_loads():
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.planner.perf import A2ALoads

    R = 8
    shape = ModelShape(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=64, ffn_dim=512, vocab_size=100,
                       num_experts=R, top_k=2, expert_ffn_dim=512)
    costs = CostModel("a100", "bf16").moe_layer_costs(shape, list(range(R)), 1024, 1024)
    rng = np.random.default_rng(2)
    t_RR = rng.integers(0, 500, (R, R)).astype(float)
    np.fill_diagonal(t_RR, 0)
    loads = A2ALoads(costs.links, t_RR, costs.token_bytes)
    for i in (0, 5):
        moved = np.minimum(t_RR[:, i], rng.integers(0, 300, R))
        loads.move(i, moved)
        t_RR[:, i] -= moved
    fresh = A2ALoads(costs.links, t_RR, costs.token_bytes)
    np.testing.assert_allclose(loads.dispatch_L, fresh.dispatch_L, rtol=1e-12, atol=1e-6)
    np.testing.assert_allclose(loads.combine_L, fresh.combine_L, rtol=1e-12, atol=1e-6)
    assert not np.allclose(fresh.dispatch_L, fresh.combine_L)  # the reverse traffic loads other links


@pytest.mark.parametrize("profile", ["a100", "h100", "rtx3090-nvlink"])
@pytest.mark.parametrize("algorithm", ["fanout", "chain"])
def test_link_priced_trans_and_agg_equal_the_simulators_grouped_broadcasts(profile, algorithm):
    """A layer's Trans (every replicated expert from its owner to its holders, issued together) and Agg (the
    gradients back) cost what `CostModel.broadcast_many` says, not one transfer time per expert added up."""
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.planner.perf import replica_loads

    cost = CostModel(profile, "bf16")
    R, E = 8, 16
    shape = ModelShape(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=64, ffn_dim=512, vocab_size=100,
                       num_experts=E, top_k=2, expert_ffn_dim=512)
    costs = cost.moe_layer_costs(shape, list(range(R)), 1024, 1024, trans_algorithm=algorithm)
    topo = cost.topology(R)
    rng = np.random.default_rng(3)
    owner = np.arange(E) // 2
    for replicated in (1, 3, 8):
        held = np.zeros((R, E), bool)
        held[owner, np.arange(E)] = True
        for e in rng.choice(E, replicated, replace=False):
            held[rng.random(R) < 0.6, e] = True
        groups = [(int(owner[e]), np.flatnonzero(held[:, e]).tolist()) for e in range(E) if held[:, e].sum() > 1]
        want = [cost.time_of(cost.broadcast_many(topo, groups, b, kind, algorithm), topo)
                for b, kind in ((costs.expert_param_bytes, "broadcast"), (costs.expert_grad_bytes, "reduce"))]
        assert replica_loads(held, owner, costs).seconds() == pytest.approx(tuple(want), rel=1e-12)
    alone = cost.time_of(cost.broadcast_many(topo, [(0, list(range(R)))], costs.expert_param_bytes, "broadcast",
                                             algorithm), topo)
    four = np.zeros((R, E), bool)
    four[owner, np.arange(E)] = True
    four[:, [0, 4, 8, 12]] = True  # 4 experts of 4 owners to every rank: they share links, not queue
    trans, _ = replica_loads(four, owner, costs).seconds()
    assert trans < 4 * alone


def test_under_overlap_trans_and_agg_keep_eq_4_and_5_while_the_exchanges_stay_per_link():
    """Eq. 8 hides Trans under compute, but Trans in flight shares links with the exchanges: per-link Trans
    without that sharing over-replicates (perf.linked_times), so under overlap Trans/Agg are eq. 4/5's."""
    from moebal.planner.cost import CostModel, ModelShape

    cost = CostModel("a100", "bf16")
    R, E = 8, 8
    shape = ModelShape(dim=1024, n_layers=1, n_heads=8, n_kv_heads=8, head_dim=128, ffn_dim=4096, vocab_size=100,
                       num_experts=E, top_k=2, expert_ffn_dim=2048)
    costs = cost.moe_layer_costs(shape, list(range(R)), 16384, 4096)
    held = np.eye(R, dtype=bool)
    held[:, [0, 3]] = True
    c_RE = np.full((R, E), 100.0)
    serial, hidden = (evaluate_held(c_RE, held, np.arange(E), costs, overlap=o) for o in (False, True))
    holders = 2 * R
    assert hidden.trans_s == pytest.approx(t_trans(costs, holders, R)) != pytest.approx(serial.trans_s)
    assert hidden.agg_s == pytest.approx(t_agg(costs, holders, R))
    assert hidden.a2a_s == serial.a2a_s  # the exchanges per link either way
