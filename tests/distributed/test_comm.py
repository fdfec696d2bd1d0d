"""Differentiable uneven all-to-all and the process-group layout, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moebal.distributed.autograd import all_to_all_rows, exchange_counts
from moebal.distributed.groups import ParallelDims
from moebal.distributed.testing import run_ranks


def _splits(rank: int, world: int) -> list[int]:
    # uneven on purpose, zero blocks included: rank r sends (r + 2*j) % 3 rows to rank j
    return [(rank + 2 * j) % 3 for j in range(world)]


def _a2a_worker(rank: int, world: int) -> tuple[float, float]:
    send = _splits(rank, world)
    recv = exchange_counts(torch.tensor(send), None).tolist()
    assert recv == [_splits(j, world)[rank] for j in range(world)]
    torch.manual_seed(rank)
    x = torch.randn(sum(send), 4, requires_grad=True)
    y = all_to_all_rows(x, send, recv, None)
    # every received row must equal the row its sender put in the block for us
    offs = 0
    for j in range(world):
        torch.manual_seed(j)
        xj = torch.randn(sum(_splits(j, world)), 4)
        start = sum(_splits(j, world)[:rank])
        assert torch.equal(y[offs:offs + recv[j]], xj[start:start + recv[j]])
        offs += recv[j]
    # backward: d(sum(y * w))/dx routes w's rows back to their senders
    w = torch.arange(y.numel(), dtype=torch.float32).view_as(y) + 100 * rank
    (y * w).sum().backward()
    ref = all_to_all_rows(w, recv, send, None)
    return float((x.grad - ref).abs().max()), float(y.sum())


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_rows_forward_and_backward(world):
    for err, _ in run_ranks(_a2a_worker, world):
        assert err == 0.0


def _groups_worker(rank: int, world: int, ep: int, pp: int) -> dict[str, list[int]]:
    dims = ParallelDims(world_size=world, rank=rank, ep=ep, pp=pp).init()
    out = {}
    for axis in ("ep", "dp", "dp_ep", "pp"):
        g = dims.group(axis)
        t = torch.tensor([rank])
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(g))]
        dist.all_gather(gathered, t, group=g)
        out[axis] = [int(v) for v in gathered]
        assert out[axis] == dims.ranks_of(axis)
    return out


def test_groups_layout_on_four_ranks():
    res = run_ranks(_groups_worker, 4, 2, 1)
    assert res[0]["ep"] == [0, 1] and res[2]["ep"] == [2, 3]
    assert res[0]["dp"] == [0, 2] and res[1]["dp"] == [1, 3]
    assert res[3]["dp_ep"] == [0, 1, 2, 3]
    res = run_ranks(_groups_worker, 4, 1, 2)
    assert res[0]["pp"] == [0, 2] and res[1]["dp"] == [0, 1]


def test_bad_layout_is_a_clear_error():
    from moebal.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible"):
        ParallelDims(world_size=4, rank=0, ep=3)
