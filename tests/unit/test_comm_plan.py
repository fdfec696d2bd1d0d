"""Communication plans (moebal.planner.comm_plan): gradient chunk size, token chunks per layer, expert packing."""

from __future__ import annotations

import pytest

from moebal.errors import ConfigError
from moebal.planner.comm_plan import CommCosts, a2a_chunks, ar_chunk_bytes, exchange_time, pack_experts

IB = CommCosts(ar_latency_s=2 * 15 * 5e-6, ar_bandwidth=12.5e9, a2a_latency_s=15 * 5e-6, a2a_bandwidth=12.5e9,
               expert_tokens_per_s=2e6)


def test_chunk_size_lands_next_to_linas_30_mb_on_infiniband():
    s = ar_chunk_bytes(IB)
    assert 25e6 < s < 45e6, s
    # latency share of one chunk is the requested 5 %
    t = IB.ar_latency_s + s / IB.ar_bandwidth
    assert IB.ar_latency_s / t == pytest.approx(0.05)


def test_exchange_time_one_chunk_is_serial_and_chunks_hide_compute():
    a, f, lat = 10e-3, 8e-3, 1e-4
    assert exchange_time(1, a, f, lat, 1.0) == pytest.approx(2 * (lat + a) + f)
    assert exchange_time(1, a, f, lat, 0.0) == pytest.approx(2 * (lat + a) + f)
    assert exchange_time(4, a, f, lat, 1.0) < exchange_time(1, a, f, lat, 1.0)
    # no real concurrency: chunks only add latency
    assert exchange_time(4, a, f, lat, 0.0) > exchange_time(1, a, f, lat, 0.0)


def test_a2a_chunks_follow_the_overlap_the_machine_allows():
    rows = 16384
    c_gpu, t_gpu = a2a_chunks(IB, recv_bytes=rows * 2048 * 2, compute_rows=rows)
    assert c_gpu > 1
    cpu = CommCosts(**{**IB.to_dict(), "overlap": 0.0})
    assert a2a_chunks(cpu, recv_bytes=rows * 2048 * 2, compute_rows=rows)[0] == 1
    # tiny exchanges are never chunked (each chunk would be all latency)
    assert a2a_chunks(IB, recv_bytes=8e3, compute_rows=4)[0] == 1


def test_pack_experts_doubles_while_compute_is_shorter_than_the_transfer():
    # all-to-all shrinks as groups shrink, compute per micro-op grows with the experts per rank
    assert pack_experts(16, 16, t_ffn=lambda m: 1.0 * m, t_a2a=lambda m: 3.0) == 4
    assert pack_experts(16, 16, t_ffn=lambda m: 5.0, t_a2a=lambda m: 3.0) == 1
    assert pack_experts(8, 2, t_ffn=lambda m: 0.0, t_a2a=lambda m: 1.0) == 8  # up to pure data parallelism
    with pytest.raises(ConfigError):
        pack_experts(6, 4, t_ffn=lambda m: 0.0, t_a2a=lambda m: 1.0)


def test_bad_costs_are_config_errors():
    with pytest.raises(ConfigError, match="overlap"):
        CommCosts(**{**IB.to_dict(), "overlap": 1.5})
    with pytest.raises(ConfigError, match="ar_bandwidth"):
        CommCosts(**{**IB.to_dict(), "ar_bandwidth": 0.0})


def test_lina_packing_doubles_while_compute_is_shorter_and_the_gradient_guard_allows():
    from moebal.balance.packing import candidate_layouts
    from moebal.planner.comm_plan import PackingCandidate, lina_packing

    assert candidate_layouts(16, 4, 4) == [4, 2, 1] and candidate_layouts(8, 6, 2) == [2, 1]
    assert candidate_layouts(12, 8, 4) == [4, 2, 1] and candidate_layouts(6, 6, 3) == [3]
    c = PackingCandidate
    # the transfer dwarfs the compute at every size and syncing experts is cheap: pack all the way (ep 1)
    ep, why = lina_packing([c(4, 1e-3, 8e-3, 0.0), c(2, 1e-3, 6e-3, 1e-3), c(1, 1e-3, 0.0, 3e-3)])
    assert ep == 1 and len(why) == 3 and "->" in why[0] and "->" in why[1] and "no smaller layout" in why[2]
    # Lina's rule stops where the compute covers the transfer
    ep, why = lina_packing([c(4, 1e-3, 8e-3, 0.0), c(2, 7e-3, 6e-3, 1e-3), c(1, 1e-3, 0.0, 3e-3)])
    assert ep == 2 and "Lina's rule" in why[-1]
    # the guard: halving saves 4 x (8 - 7) = 4 ms of all-to-all but adds 5 ms of expert-gradient all-reduce
    ep, why = lina_packing([c(4, 1e-3, 8e-3, 0.0), c(2, 1e-3, 7e-3, 5e-3)])
    assert ep == 4 and "would save 4 ms" in why[0] and "add 5 ms" in why[0]
    assert lina_packing([c(2, 1e-3, 1e-2, 0.0)]) == (2, [])
