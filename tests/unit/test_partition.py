"""Stage partitioners against brute force, and the diffusion balancer's guarantees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebal.errors import ConfigError
from moebal.planner.partition import (
    diffuse,
    imbalance,
    migration_layers,
    partition_by_time,
    partition_uniform,
    pipeline_time,
    should_adopt,
    stage_loads,
)


def _brute(costs, P, memory=None, cap=np.inf, first=0.0, last=0.0):
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), P - 1):
        bounds = (0, *cuts, L)
        sizes = [bounds[i + 1] - bounds[i] for i in range(P)]
        if memory is not None and any(sum(memory[bounds[i]:bounds[i + 1]]) > cap for i in range(P)):
            continue
        m = max(stage_loads(costs, sizes, first, last))
        if best is None or m < best - 1e-12:
            best = m
    return best


costs_st = st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=300, deadline=None)
@given(costs=costs_st, data=st.data())
def test_partition_is_optimal_against_brute_force(costs, data):
    P = data.draw(st.integers(1, len(costs)))
    first = data.draw(st.sampled_from([0.0, 2.5]))
    last = data.draw(st.sampled_from([0.0, 4.0]))
    sizes = partition_by_time(costs, P, first_extra=first, last_extra=last)
    assert len(sizes) == P and all(s >= 1 for s in sizes) and sum(sizes) == len(costs)
    got = max(stage_loads(costs, sizes, first, last))
    assert got == pytest.approx(_brute(costs, P, first=first, last=last), abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(costs=costs_st, data=st.data())
def test_partition_with_memory_caps_is_optimal_or_says_infeasible(costs, data):
    P = data.draw(st.integers(1, len(costs)))
    memory = data.draw(st.lists(st.floats(0.1, 5.0), min_size=len(costs), max_size=len(costs)))
    cap = data.draw(st.floats(0.5, 20.0))
    ref = _brute(costs, P, memory, cap)
    if ref is None:
        with pytest.raises(ConfigError, match="memory caps"):
            partition_by_time(costs, P, memory=memory, capacity=cap)
        return
    sizes = partition_by_time(costs, P, memory=memory, capacity=cap)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    assert all(sum(memory[bounds[i]:bounds[i + 1]]) <= cap + 1e-9 for i in range(P))
    assert max(stage_loads(costs, sizes)) == pytest.approx(ref, abs=1e-9)


def _random_partition(data, L, P):
    cuts = sorted(data.draw(st.lists(st.integers(1, L - 1), min_size=P - 1, max_size=P - 1, unique=True))) \
        if P > 1 else []
    bounds = (0, *cuts, L)
    return [bounds[i + 1] - bounds[i] for i in range(P)]


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.integers(0, 3), min_size=1, max_size=9), data=st.data())
def test_partition_from_current_moves_the_fewest_layers_among_the_optimal(costs, data):
    # small integer costs make many partitions optimal: the one returned must move the fewest layers from the
    # current partition of every optimal one (brute force), under the same extras and memory caps
    L = len(costs)
    P = data.draw(st.integers(1, L))
    current = _random_partition(data, L, P)
    first, last = data.draw(st.sampled_from([0.0, 2.0])), data.draw(st.sampled_from([0.0, 1.0]))
    memory = data.draw(st.lists(st.integers(1, 3), min_size=L, max_size=L))
    cap = data.draw(st.sampled_from([np.inf, 6.0]))
    ref = _brute(costs, P, memory, cap, first, last)
    if ref is None:
        return
    sizes = partition_by_time(costs, P, memory=memory, capacity=cap, first_extra=first, last_extra=last,
                              current=current)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    assert all(sum(memory[bounds[i]:bounds[i + 1]]) <= cap for i in range(P))
    assert max(stage_loads(costs, sizes, first, last)) == pytest.approx(ref, abs=1e-9)
    fewest = min(len(migration_layers(current, s)) for s in
                 ([c[i + 1] - c[i] for i in range(P)] for c in ((0, *cuts, L) for cuts in
                                                                itertools.combinations(range(1, L), P - 1)))
                 if max(stage_loads(costs, s, first, last)) <= ref + 1e-9
                 and all(sum(memory[b:e]) <= cap for b, e in zip(np.cumsum([0, *s[:-1]]), np.cumsum(s))))
    assert len(migration_layers(current, sizes)) == fewest


def test_partition_keeps_the_current_one_when_it_is_already_optimal():
    # the README's `moebal plan stages` example: the uniform split already has the optimal maximum (2)
    costs = [1, 1, 1, 1, 0.5, 0.5, 0.2, 0.2]
    assert partition_by_time(costs, 4) == [1, 1, 2, 4]  # no current partition: earliest boundaries
    assert partition_by_time(costs, 4, current=[2, 2, 2, 2]) == [2, 2, 2, 2]
    assert partition_by_time(costs, 4, current=[1, 1, 3, 3]) == [1, 1, 2, 4]  # one layer moves
    with pytest.raises(ConfigError, match="3 stages, not 4"):
        partition_by_time(costs, 4, current=[2, 3, 3])


def test_partition_worked_example_early_exit_profile():
    # 12 layers of 1.0 then 0.9^k: the extraction's example; optimum max 5.0 with boundaries [0,5,10,15,24]
    costs = [1.0] * 12 + [0.9 ** k for k in range(1, 13)]
    sizes = partition_by_time(costs, 4)
    assert max(stage_loads(costs, sizes)) == pytest.approx(5.0)
    assert sizes == partition_by_time(costs, 4)  # deterministic among the optimal partitions
    assert max(stage_loads(costs, partition_uniform(24, 4))) == pytest.approx(6.0)


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=16), data=st.data())
def test_diffusion_never_raises_max_and_keeps_order(costs, data):
    P = data.draw(st.integers(2, len(costs)))
    start = partition_uniform(len(costs), P)
    before = max(stage_loads(costs, start))
    after_sizes = diffuse(costs, start)
    assert len(after_sizes) == P and all(s >= 1 for s in after_sizes) and sum(after_sizes) == len(costs)
    assert max(stage_loads(costs, after_sizes)) <= before + 1e-12
    loads_a, loads_b = stage_loads(costs, start), stage_loads(costs, after_sizes)
    assert np.var(loads_b) <= np.var(loads_a) + 1e-12


def test_diffusion_respects_memory_cap():
    costs = [1, 1, 1, 1, 8, 8]
    memory = [1.0] * 6
    sizes = diffuse(costs, [2, 2, 2], memory=memory, capacity=2.0)
    assert sizes == [2, 2, 2]  # every neighbour is full
    assert diffuse(costs, [2, 2, 2])[2] == 1  # without the cap a layer leaves the heavy stage
    for wrong in (memory[:1], [*memory, 1.0]):  # one value per layer, as partition_by_time asks
        with pytest.raises(ConfigError, match="give one value per layer"):
            diffuse(costs, [2, 2, 2], memory=wrong, capacity=2.0)


def test_diffusion_counts_the_pinned_embedding_and_head_against_the_cap():
    # stage 0 holds the embedding (1 unit of memory) beside its layers: a third layer would put it at 4 > 3,
    # which the exact partitioner refuses too
    costs, mem = [1.0, 1.0, 1.0, 3.0], [1.0] * 4
    assert diffuse(costs, [2, 2], memory=mem, capacity=3.0, first_memory=1.0) == [2, 2]
    assert partition_by_time(costs, 2, memory=mem, capacity=3.0, first_memory=1.0) == [2, 2]
    assert diffuse(costs, [2, 2], memory=mem, capacity=3.0) == [3, 1]  # without it the move fits
    # the head on the last stage: the layers move the other way only while the head fits beside them
    assert diffuse([3.0, 1.0, 1.0, 1.0], [2, 2], memory=mem, capacity=3.0, last_memory=1.0) == [2, 2]


def test_diffusion_moves_along_a_chain_where_one_hop_stalls():
    """A smooth gradient of loads: every adjacent gap (0.17) is below every layer's cost (>= 1), so no one-hop
    move lowers the variance; chains of adjacent moves reach the exact min-max partition."""
    costs = list(np.linspace(2.0, 1.0, 24))
    start = [3] * 8
    loads = stage_loads(costs, start)
    assert all(loads[p] - loads[p + 1] < min(costs) for p in range(7))  # the one-hop rule has no move
    sizes = diffuse(costs, start)
    assert sizes == [2, 2, 3, 3, 3, 3, 4, 4]
    best = max(stage_loads(costs, partition_by_time(costs, 8)))
    assert max(stage_loads(costs, sizes)) == pytest.approx(best)
    assert best < max(loads) / 1.09


def test_diffusion_chain_by_hand_prefers_one_hop_and_respects_memory():
    # loads [4, 2, 2] (costs 2 2 | 1 1 | 1 1): the one hop 4 -> 2 gives [2, 4, 2], no better; the chain 0 -> 1 -> 2
    # (stage 0 gives layer 1, stage 1 passes its last layer on) gives [2, 3, 3]
    assert diffuse([2, 2, 1, 1, 1, 1], [2, 2, 2]) == [1, 2, 3]
    # ... unless the chain's last stage has no memory left for the layer it receives
    assert diffuse([2, 2, 1, 1, 1, 1], [2, 2, 2], memory=[1.0] * 6, capacity=2.0) == [2, 2, 2]
    # loads [4, 3, 3] (2 2 | 3 | 1 1 1): the chain passes on the 3 and gives [2, 2, 6]: the maximum would rise
    assert diffuse([2, 2, 3, 1, 1, 1], [2, 1, 3]) == [2, 1, 3]
    # loads [4, 3, 2] (2 2 | 1 2 | 1 1): the chain gives [2, 3, 4], the same maximum and sum of squares: no move
    assert diffuse([2, 2, 1, 2, 1, 1], [2, 2, 2]) == [2, 2, 2]
    # one hop where it lowers the variance: loads [5, 1, 4] (1 2 2 | 1 | 2 2): stage 0 gives its last layer to
    # stage 1 ([3, 3, 4]), no chain
    assert diffuse([1, 2, 2, 1, 2, 2], [3, 1, 2], max_rounds=1) == [2, 2, 2]


def test_uniform_and_errors():
    assert partition_uniform(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ConfigError, match="at least one layer"):
        partition_by_time([1, 2], 3)
    with pytest.raises(ConfigError, match="non-negative"):
        partition_by_time([1, -2], 1)
    with pytest.raises(ConfigError, match="one value per layer"):
        partition_by_time([1, 2], 1, memory=[1])
    with pytest.raises(ConfigError, match="at least one layer"):
        stage_loads([1, 2, 3], [3, 0])


def test_migration_and_adoption_rule():
    assert migration_layers([2, 2], [1, 3]) == [(1, 0, 1)]
    costs = [4.0, 1.0, 1.0, 1.0]
    cur, new = [2, 2], [1, 3]
    # iteration time drops from (4+1)*5 = 25 to (4+1)*4 = 20 with 4 micro-batches
    assert pipeline_time(stage_loads(costs, cur), 4) == 25 and pipeline_time(stage_loads(costs, new), 4) == 20
    adopt, gain, cost = should_adopt(costs, cur, new, 4, interval_iters=10, layer_bytes=[100.0] * 4,
                                     bandwidth_Bps=10.0)
    assert adopt and gain == 50 and cost == 10
    adopt, _, _ = should_adopt(costs, cur, new, 4, interval_iters=1, layer_bytes=[100.0] * 4, bandwidth_Bps=10.0)
    assert not adopt
    assert imbalance([2.0, 1.0, 3.0]) == pytest.approx(1.5)


def test_hysteresis_takes_a_small_gain_only_when_it_keeps_winning():
    from moebal.planner.partition import clears_hysteresis

    assert clears_hysteresis(1.0, 0.95, 0.05, streak=1, confirm=2)  # min_gain: at once
    assert not clears_hysteresis(1.0, 0.97, 0.05, streak=1, confirm=2)  # 3 %: wait for a second plan point
    assert clears_hysteresis(1.0, 0.97, 0.05, streak=2, confirm=2)
    assert not clears_hysteresis(1.0, 0.995, 0.05, streak=5, confirm=2)  # below a fifth of min_gain: never
    assert not clears_hysteresis(1.0, 0.97, 0.05, streak=9, confirm=0)  # confirm 0: the threshold alone


def test_confirm_fraction_sets_the_confirmed_threshold() -> None:
    from moebal.config import load
    from moebal.planner.partition import clears_hysteresis

    assert not clears_hysteresis(1.0, 0.995, 0.05, streak=2, confirm=2)  # 0.5 %: under a fifth of min_gain
    assert clears_hysteresis(1.0, 0.995, 0.05, streak=2, confirm=2, confirm_fraction=0.1)
    assert not clears_hysteresis(1.0, 0.97, 0.05, streak=2, confirm=2, confirm_fraction=0.8)
    assert load(None, ["pipeline.confirm_fraction=0.5"]).pipeline.confirm_fraction == 0.5
    with pytest.raises(ConfigError, match="pipeline.confirm_fraction"):
        load(None, ["pipeline.confirm_fraction=1.5"])
