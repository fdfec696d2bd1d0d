"""The MoE time of a forward over expert-parallel ranks (`slowest_rank_times`, `slowest_rank_parts`): each layer
counts its slowest rank, with that rank's own parts, summed over the layers."""

from __future__ import annotations

from moebal.distributed.lina_inference import slowest_rank_parts, slowest_rank_times


def _rec(seconds: float, experts: float, plan: float, exchange: float) -> dict[str, float]:
    return {"seconds": seconds, "experts_s": experts, "plan_s": plan, "exchange_s": exchange}


def test_each_layer_counts_its_slowest_rank_and_that_rank_s_parts() -> None:
    # two ranks, one forward of two layers: rank 1 is the slower in layer 0 (though it waited less), rank 0 in
    # layer 1; then a second forward of one layer where the ranks tie (the first rank's record counts)
    rank0 = [[_rec(5.0, 1.0, 0.5, 3.0), _rec(9.0, 6.0, 0.5, 2.0)], [_rec(2.0, 1.0, 0.0, 1.0)]]
    rank1 = [[_rec(6.0, 4.0, 0.5, 1.0), _rec(7.0, 2.0, 0.5, 4.0)], [_rec(2.0, 0.5, 0.0, 1.5)]]
    parts = slowest_rank_parts([rank0, rank1])
    assert parts == [_rec(15.0, 10.0, 1.0, 3.0), _rec(2.0, 1.0, 0.0, 1.0)]
    assert slowest_rank_times([rank0, rank1]) == [15.0, 2.0]
