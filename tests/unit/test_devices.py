"""Devices without a GPU: the process-group backend and timeout, which device each bookkeeping collective uses,
ranks per GPU, and the CPU-only benchmark modes refused on CUDA. CUDA is faked where the code asks for it
(`torch.cuda.*` and `torch.distributed` calls are recorded, not run)."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from moebal import config as C
from moebal.distributed import groups
from moebal.distributed.groups import ParallelDims, backend_for, check_ranks_fit, pick_device
from moebal.errors import ConfigError
from moebal.launch.spawn import local_ranks
from moebal.train.distributed import RunContext

CUDA0 = torch.device("cuda", 0)


def test_backend_is_device_aware_on_cuda_and_gloo_on_cpu():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(CUDA0) == "cpu:gloo,cuda:nccl"
    # what torch makes of it: CPU tensors to gloo, CUDA tensors to NCCL
    assert BackendConfig(dist.Backend(backend_for(CUDA0))).get_device_backend_map() == {"cpu": "gloo",
                                                                                       "cuda": "nccl"}


class _FakeDist:
    """Records the process-group calls `ParallelDims` makes (one rank of `world`, nothing real started)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.init: dict[str, Any] = {}
        self.groups: list[dict[str, Any]] = []
        self.reduced: list[tuple[Any, torch.device]] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(self.init))
        monkeypatch.setattr(dist, "init_process_group", lambda **kw: self.init.update(kw))
        monkeypatch.setattr(dist, "new_group", self._new_group)
        monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, **kw: self.reduced.append((group, t.device)))
        monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD="WORLD"))
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
        # the warm-up's CUDA tensor, on a machine without CUDA: a meta tensor stands in for it
        monkeypatch.setattr(groups, "_devices", lambda d: (torch.device("cpu"), torch.device("meta"))
                            if d.type == "cuda" else (d,))

    def _new_group(self, ranks: list[int], **kw: Any) -> str:
        self.groups.append({"ranks": ranks, **kw})
        return f"g{len(self.groups) - 1}:{ranks}"


def test_cuda_init_binds_the_device_uses_the_mixed_backend_and_warms_every_group(monkeypatch):
    fake = _FakeDist(monkeypatch)
    dims = ParallelDims(world_size=4, rank=1, ep=2, device=CUDA0).init(timeout_s=60.0 * 30)
    assert fake.init["backend"] == "cpu:gloo,cuda:nccl"
    assert fake.init["device_id"] == CUDA0  # eager NCCL communicators, subgroups split from the default one
    assert fake.init["timeout"] == datetime.timedelta(minutes=30)
    assert fake.groups and all(g["backend"] == "cpu:gloo,cuda:nccl" for g in fake.groups)
    assert all(g["timeout"] == datetime.timedelta(minutes=30) for g in fake.groups)
    # every group this rank is in, both backends, from this (the main) thread
    mine = {dims.group(a) for a in ("ep", "dp", "dp_ep", "pp", "world")}
    for g in mine:
        assert {d.type for grp, d in fake.reduced if grp == g} == {"cpu", "meta"}, g


def test_cpu_init_is_gloo_without_a_device_binding(monkeypatch):
    fake = _FakeDist(monkeypatch)
    ParallelDims(world_size=2, rank=0).init()
    assert fake.init["backend"] == "gloo" and "device_id" not in fake.init
    assert fake.init["timeout"] == datetime.timedelta(minutes=30)  # the default: parallel.timeout_min
    assert {d.type for _, d in fake.reduced} == {"cpu"}


def test_high_priority_channel_gets_fresh_nccl_options_per_group(monkeypatch):
    fake = _FakeDist(monkeypatch)

    class Options:
        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream
            self._timeout = None

    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    dims = ParallelDims(world_size=4, rank=0, ep=2, device=CUDA0).init()
    n = len(fake.groups)
    ch = dims.new_channel("ep", high_priority=True, timeout_s=120.0)
    made = fake.groups[n:]
    assert len(made) == 2 and ch == f"g{n}:[0, 1]"
    opts = [g["pg_options"] for g in made]
    assert opts[0] is not opts[1]  # torch writes the group's name and ranks into them
    assert all(o.is_high_priority_stream and o._timeout == datetime.timedelta(seconds=120) for o in opts)
    assert all(g["backend"] == "cpu:gloo,cuda:nccl" for g in made)  # CPU tensors still work on the channel
    assert any(grp == ch for grp, _ in fake.reduced)  # warmed before the scheduler's thread can use it
    plain = dims.new_channel("dp")
    assert fake.groups[-1]["pg_options"] is None and plain is not None


def test_ranks_per_gpu():
    assert local_ranks(None, 0) == 2 and local_ranks(3, 0) == 3  # CPU: parallel.nproc, default 2
    assert local_ranks(None, 8) == 8 and local_ranks(2, 8) == 2  # CUDA: one per visible GPU by default
    with pytest.raises(ConfigError) as e:
        local_ranks(2, 1)
    assert "2 ranks on this machine but 1 visible GPU" in str(e.value) and "at most 1" in str(e.value)
    check_ranks_fit(4, 4)


def test_pick_device_refuses_two_ranks_on_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device(1, 2) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="3 ranks on this machine but 2 visible GPU"):
        pick_device(0, 3)
    with pytest.raises(ConfigError):
        pick_device(2)  # LOCAL_RANK 2 on a two-GPU machine


@pytest.mark.parametrize("overrides, named", [
    (["pipeline.wait=spin"], "pipeline.wait: spin"),
    (["pipeline.dilate=3"], "pipeline.dilate: 3"),
    (["scheduler.dilate=2.5"], "scheduler.dilate: 2.5"),
])
def test_cpu_only_modes_are_refused_on_cuda_in_one_line(overrides, named):
    cfg = C.with_overrides(C.Config(), overrides)
    C.refuse_cpu_only(cfg, "cpu")  # what they are for
    with pytest.raises(ConfigError) as e:
        C.refuse_cpu_only(cfg, "cuda")
    msg = str(e.value)
    assert named in msg and "refused on cuda" in msg and "\n" not in msg
    C.refuse_cpu_only(C.Config(), "cuda")  # the defaults run anywhere


# ---- which device each bookkeeping collective uses --------------------------------------------------------

@pytest.fixture
def reduced(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        out.append(t)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return out


def _ctx(ep: int = 1) -> RunContext:
    return RunContext(ParallelDims(world_size=2, rank=0, ep=ep))  # groups never built: collectives are recorded


def test_host_bookkeeping_goes_to_gloo_as_cpu_tensors(reduced):
    ctx = _ctx()
    ctx.mean(1.5)
    ctx.sum([1.0, 2.0])
    ctx.global_rows(np.ones((1, 3)), 2)
    assert len(reduced) == 3 and all(t.device.type == "cpu" for t in reduced)


def test_device_values_stay_on_their_device(reduced):
    ctx = _ctx()
    loss, aux = torch.tensor(2.0, device="meta"), torch.tensor(0.5, device="meta")
    with pytest.raises(NotImplementedError):  # a meta tensor has no value to read: the reduction was on "meta"
        ctx.means([loss, aux])
    assert len(reduced) == 1 and reduced[0].device.type == "meta" and reduced[0].dtype == torch.float64
    assert _ctx().means([torch.tensor(2.0), torch.tensor(0.5)]) == [1.0, 0.25]  # / 2 ranks (a recorded all-reduce)


def test_gradient_norm_accumulators_live_on_the_gradients_device(reduced):
    """Expert-parallel clipping with no expert parameter: the expert accumulator is built, then all-reduced over
    ep, on the gradients' device (a CPU zero added to CUDA norms was the bug)."""
    model = torch.nn.Linear(2, 2, device="meta")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    total = _ctx(ep=2).clip_grad_norm(model, float("inf"))
    assert total.device.type == "meta"
    assert len(reduced) == 1 and reduced[0].device.type == "meta"


@pytest.mark.parametrize("ep", [1, 2])
def test_clipping_with_the_norm_below_max_norm_changes_no_gradient(reduced, ep):
    """The distributed clip (2 ranks; the all-reduce recorded, so the norm is this rank's) follows torch's
    clip_grad_norm_: a max_norm above the norm keeps every gradient, dense and expert, bit for bit (the
    coefficient is clamped at 1); one below scales them to it, as torch's does."""
    from moebal.distributed.expert_parallel import _EXPERT_ATTR

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    setattr(model[1].weight, _EXPERT_ATTR, True)  # as ExpertParallel marks its experts' weights
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.grad.clone() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in before]))
    got = _ctx(ep).clip_grad_norm(model, 10 * float(norm))
    assert float(got) == pytest.approx(float(norm), rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    ref = [torch.nn.Parameter(b.clone()) for b in before]
    for r, b in zip(ref, before):
        r.grad = b.clone()
    torch.nn.utils.clip_grad_norm_(ref, float(norm) / 4)
    _ctx(ep).clip_grad_norm(model, float(norm) / 4)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad)


def test_set_chunk_bytes_agrees_on_the_host(reduced):
    from moebal.distributed.expert_parallel import ExpertParallel

    rebuilt: list[float] = []
    fake = SimpleNamespace(dims=ParallelDims(world_size=2, rank=0, device=CUDA0), _rebuild_grads=rebuilt.append)
    ExpertParallel.set_chunk_bytes(fake, 4e6)  # type: ignore[arg-type]
    assert len(reduced) == 1 and reduced[0].device.type == "cpu" and rebuilt == [4e6]


def test_setup_parallel_uses_the_process_group_timeout_not_the_schedulers(monkeypatch):
    from moebal.train import distributed as D

    seen: list[float] = []

    class Stop(Exception):
        pass

    class Dims:
        def init(self, timeout_s: float) -> None:
            seen.append(timeout_s)
            raise Stop

    monkeypatch.setattr(D.ParallelDims, "from_env", classmethod(lambda cls, ep=1, pp=1: Dims()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = C.with_overrides(C.Config(), ["parallel.timeout_min=45", "scheduler.timeout_s=7"])
    with pytest.raises(Stop):
        D.setup_parallel(cfg)
    assert seen == [45 * 60.0]


# ---- pipeline messages: one group per direction ------------------------------------------------------------

def test_pipeline_messages_travel_on_one_group_per_direction(monkeypatch):
    """On NCCL a send holds its communicator's stream until the receive is posted: stage p's forward send and
    stage p + 1's backward send must not share a stream, or 1F1B deadlocks. Every message toward a later
    chain member goes on the first group, every message toward an earlier one on the second."""
    from moebal.pipeline.p2p import PipeChain

    used: list[tuple[str, int, Any]] = []
    work = SimpleNamespace(wait=lambda: None, is_completed=lambda: False)
    monkeypatch.setattr(dist, "isend", lambda t, dst, group=None: used.append(("send", dst, group)) or work)
    monkeypatch.setattr(dist, "irecv", lambda t, src, group=None: used.append(("irecv", src, group)) or work)
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: used.append(("recv", src, group)))
    t = torch.zeros(2)
    chain = PipeChain([3, 5, 7], 5, groups=("later", "earlier"))
    chain.send(t, 7)  # an activation
    chain.recv(t, 7)  # a gradient
    chain.send(t, 3)  # a gradient
    chain.recv(t, 3)  # an activation
    chain.post_recv(t, 3)
    chain.post_send(t, 7)
    assert used == [("send", 7, "later"), ("recv", 7, "earlier"), ("send", 3, "earlier"), ("recv", 3, "later"),
                    ("irecv", 3, "later"), ("send", 7, "later")]
    first = PipeChain([3, 5, 7], 3, groups=("later", "earlier"))
    first.shrink([3, 7])  # re-packed: 5 released, the order of the rest kept
    used.clear()
    first.send(t, 7)
    assert used == [("send", 7, "later")]
    used.clear()
    PipeChain([0, 1], 0).send(t, 1)  # no groups: the default group, as before
    assert used == [("send", 1, None)]


def test_pipeline_groups_are_built_and_warmed_only_with_stages(monkeypatch):
    fake = _FakeDist(monkeypatch)
    dims = ParallelDims(world_size=4, rank=2, pp=2).init()
    pair = dims.pipe_groups()
    assert pair is not None and pair[0] != pair[1]
    assert all(g in {grp for grp, _ in fake.reduced} for g in pair)
    assert all(g.endswith(f":{dims.ranks_of('pp')}") for g in pair)  # over this rank's pipeline
    assert ParallelDims(world_size=2, rank=0).init().pipe_groups() is None


def test_chain_agreements_take_host_tensors_only():
    """`allreduce_sum` and `allgather_1d` send to every member before receiving: fine on gloo, a possible
    deadlock on NCCL, so a device tensor is refused (every caller passes host bookkeeping)."""
    from moebal.pipeline.p2p import PipeChain

    chain = PipeChain([0, 1], 0)
    with pytest.raises(AssertionError, match="CPU tensors"):
        chain.allreduce_sum(torch.zeros(2, device="meta"))
    with pytest.raises(AssertionError, match="CPU tensors"):
        chain.allgather_1d(torch.zeros(2, device="meta"))
    assert PipeChain([0], 0).allreduce_sum(torch.ones(2)).tolist() == [1.0, 1.0]
