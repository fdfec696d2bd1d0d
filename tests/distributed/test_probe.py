"""The one alpha-beta link probe (`moebal.distributed.probe`): the fit, and a probe on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from moebal.distributed.probe import fit_link, probe_link, slowest_over
from moebal.distributed.testing import run_ranks


def test_fit_recovers_latency_and_bandwidth():
    link = fit_link(1000, 1e-3 + 1000 / 2e9, 10**6, 1e-3 + 10**6 / 2e9)
    assert link.latency_s == pytest.approx(1e-3) and link.bandwidth == pytest.approx(2e9)
    assert link.seconds(2e9) == pytest.approx(1.001)
    noisy = fit_link(1000, 2e-3, 10**6, 1e-3)  # the large message timed faster: a fast link, no negative figure
    assert noisy.bandwidth > 1e11 and noisy.latency_s >= 0.0
    with pytest.raises(ValueError, match="small < large"):
        fit_link(10, 1.0, 10, 2.0)


def _probe(rank: int, world: int) -> tuple[float, float, float, float]:
    all_reduce = probe_link(lambda b: dist.all_reduce(b), torch.device("cpu"), repeats=3, agree=slowest_over())
    peer = 1 - rank

    def round_trip(b: torch.Tensor) -> None:
        if rank == 0:
            dist.send(b, peer)
            dist.recv(b, peer)
        else:
            dist.recv(b, peer)
            dist.send(b, peer)

    p2p = probe_link(round_trip, torch.device("cpu"), sizes=(4096, 4 << 20), repeats=3, legs=2,
                     agree=slowest_over())
    return all_reduce.latency_s, all_reduce.bandwidth, p2p.latency_s, p2p.bandwidth


def test_probe_on_two_ranks_agrees_and_is_positive():
    a, b = run_ranks(_probe, 2)
    assert a == b  # every rank fits from the slowest rank's times: identical figures
    assert all(x > 0 for x in (a[1], a[3])) and a[0] >= 0 and a[2] >= 0
