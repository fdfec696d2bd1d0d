"""Lina's first-fit-decreasing allocation (moebal/planner/ffd.py) on cases built from the thesis's rules.

The thesis (section 4.5) gives the rules, not a numeric example; each case below quotes the rule it checks:
  "n_e = N x sum_t P_j(t)(e) / N_t" (Eq. 4.1),
  "we adopt the first-fit-decreasing heuristic to pack them into the empty devices so the total devices used
   are minimized",
  "experts ... not amongst the top-k list of any tokens ... are assigned evenly to the remaining free devices if
   any; otherwise are randomly assigned to a device",
  "We set a maximum number of experts per device" (4, section 4.7).
"""

from __future__ import annotations

import numpy as np
import pytest

from moebal.planner.ffd import ReplicaMap, devices_from_load, ffd_allocate, split_rows


def test_eq_4_1_devices_from_load() -> None:
    # 4 devices, 100 tokens, top-1: an expert that half the tokens pick needs 2 devices
    assert devices_from_load([50, 25, 15, 10], 4, 100) == [2.0, 1.0, 0.6, 0.4]
    assert devices_from_load([1, 1], 4, 0) == [0.0, 0.0]


def test_no_holder_takes_fewer_than_min_rows_of_an_expert() -> None:
    # the same shares at 100 rows: with min_rows 64 expert 0's 50 rows stay on one device (two holders of 25 rows
    # would each compute a padded group of 64); at 200 rows (100 for expert 0) still one; at 400, two
    assert devices_from_load([50, 25, 15, 10], 4, 100, min_rows=64) == [1.0, 1.0, 0.6, 0.4]
    assert devices_from_load([100, 50, 30, 20], 4, 200, min_rows=64) == [1.0, 1.0, 0.6, 0.4]
    assert devices_from_load([200, 100, 60, 40], 4, 400, min_rows=64) == [2.0, 1.0, 0.6, 0.4]
    # an expert of 6 ranks' worth of work gets what its rows fill: floor(300 / 64) = 4; 100 rows fill one
    assert devices_from_load([300, 100], 8, 400, min_rows=64) == [4.0, 1.0]
    # the decode step's shape: 16 tokens, one hot expert of 10 rows: no replica, and none a holder of 0 rows
    assert devices_from_load([10, 4, 2, 0], 2, 16, min_rows=64) == [1.0, 0.5, 0.25, 0.0]


def test_popular_expert_gets_whole_devices_and_small_ones_are_packed() -> None:
    # n = [2, 1, 0.6, 0.4] on 4 devices: expert 0 on two devices (replicas), expert 1 alone, 2 and 3 share one
    m = ffd_allocate([2.0, 1.0, 0.6, 0.4], 4)
    assert m.holders == ((0, 1), (2,), (3,), (3,))
    assert m.shares[0] == (0.5, 0.5)


def test_fractional_replica_and_first_fit_order() -> None:
    # n = [1.5, 0.3, 0.2, 0.5, 0.5] on 3 devices: pieces 1, 0.5 (expert 0), 0.5 (3), 0.5 (4), 0.3, 0.2
    # first fit, largest first: rank 0 <- e0 (1.0); rank 1 <- e0 (0.5) + e3 (0.5); rank 2 <- e4 + e1 + e2
    m = ffd_allocate([1.5, 0.3, 0.2, 0.5, 0.5], 3)
    assert m.holders == ((0, 1), (2,), (2,), (1,), (2,))
    assert m.shares[0] == pytest.approx((2 / 3, 1 / 3))


def test_fewest_devices_then_unlisted_experts_spread_over_free_ones() -> None:
    # 8 experts on 4 devices; the estimate lists only experts 0-3 (n sums to 2: they fit on 2 devices);
    # the 4 unlisted experts go evenly to the 2 free devices (2 each)
    m = ffd_allocate([0.6, 0.5, 0.5, 0.4, 0, 0, 0, 0], 4)
    assert [m.local_experts(r) for r in range(4)] == [(0, 3), (1, 2), (4, 6), (5, 7)]


def test_at_most_four_experts_per_device_and_no_free_device() -> None:
    # 12 experts of 0.25 on 3 devices: FFD fills 4 per device (the cap), nothing left over
    m = ffd_allocate([0.25] * 12, 3)
    assert [len(m.local_experts(r)) for r in range(3)] == [4, 4, 4]
    # 6 small listed experts on 2 devices fit on one by load but the cap stops at 4; unlisted ones then go
    # to the device with the fewest experts ("randomly" in the thesis: deterministic here)
    m = ffd_allocate([0.1] * 6 + [0, 0], 2)
    assert [len(m.local_experts(r)) for r in range(2)] == [4, 4]
    # more experts than 4 x devices: the cap rises to ceil(E / N)
    m = ffd_allocate([0.0] * 10, 2)
    assert [len(m.local_experts(r)) for r in range(2)] == [5, 5]


def test_overflow_goes_to_least_loaded_rank() -> None:
    # n = [0.7, 0.7, 0.7] on 2 devices: the third piece fits nowhere and no device is free
    m = ffd_allocate([0.7, 0.7, 0.7], 2)
    assert m.holders == ((0,), (1,), (0,))


def test_static_map_and_validation() -> None:
    m = ReplicaMap.static(8, 4)
    assert [m.local_experts(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert ReplicaMap.static(8, 4) is m and ReplicaMap.static(8, 2) is not m  # built once per shape
    with pytest.raises(ValueError, match="sum to 1"):
        ReplicaMap(num_ranks=2, holders=((0, 1),), shares=((0.5, 0.4),))
    with pytest.raises(ValueError, match="finite"):
        ffd_allocate([-1.0], 2)


def test_split_rows_balances_replicas_and_keeps_local_rows() -> None:
    m = ReplicaMap(num_ranks=2, holders=((0, 1), (1,)), shares=((0.5, 0.5), (1.0,)))
    counts_SE = np.array([[10, 3], [2, 1]])  # expert 0: 12 rows -> 6 each; rank 1 keeps its own 2
    rows = split_rows(counts_SE, m)
    assert rows[:, :, 0].tolist() == [[6, 4], [0, 2]]
    assert rows[:, :, 1].tolist() == [[0, 3], [0, 1]]
    np.testing.assert_array_equal(rows.sum(axis=1), counts_SE)  # every row goes somewhere, once
