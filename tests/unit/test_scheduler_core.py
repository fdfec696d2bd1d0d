"""The scheduler's issue rule on one process: collectives whose launch returns no work complete at once, so
the test controls exactly what is queued or in flight when a gradient chunk becomes ready."""

from __future__ import annotations

import threading
import time

import torch

from moebal.scheduler import BackgroundOp, CommScheduler


def _chunk(started: threading.Event) -> BackgroundOp:
    def launch() -> None:
        started.set()

    return BackgroundOp("allreduce", "dp_ep allreduce 0", 1024, launch, group="dp_ep", chunk=0)


def test_look_ahead_holds_chunks_until_the_announced_all_to_all_not_until_any_critical_collective():
    """The backward pass announces a layer's all-to-all (combine started), then often runs the routing
    statistics' all-reduce before the all-to-all itself: a chunk must not slip onto the link in between."""
    sched = CommScheduler("lina", timeout_s=10)
    try:
        started = threading.Event()
        sched.begin_step([_chunk(started)])
        sched.expect_critical()
        sched.ready(0)
        sched.run("stats", lambda: None, name="balancing loss bwd", nbytes=64)  # issued and finished
        assert not started.wait(0.2), "a gradient chunk started between the announcement and its all-to-all"
        h = sched.issue("a2a", lambda: None, name="L0 combine0 bwd", nbytes=4096)
        h.wait()
        assert started.wait(5), "the chunk was held after the announced all-to-all finished"
        sched.drain()
    finally:
        sched.close()


def test_unannounced_chunks_go_at_once_and_drain_releases_a_stale_announcement():
    sched = CommScheduler("lina", timeout_s=10)
    try:
        started = threading.Event()
        sched.begin_step([_chunk(started)])
        sched.ready(0)
        assert started.wait(5)
        sched.drain()
        started2 = threading.Event()
        sched.begin_step([_chunk(started2)])
        sched.expect_critical()  # an announcement no all-to-all follows (the last layer's backward was cut)
        sched.ready(0)
        t = time.perf_counter()
        sched.drain()  # the optimizer step waits: nothing critical can come any more, the hold ends
        assert started2.is_set() and time.perf_counter() - t < 5
    finally:
        sched.close()


def test_expert_chunks_are_issued_after_every_hook_fed_chunk():
    """Expert weights are released only after Agg, at the end of the backward pass; were their chunks first in
    the one issue order (they are registered after their block's attention, so the reverse registration order
    puts them first), every dense chunk would wait behind them and nothing would go out during the backward."""
    from torch import nn

    from moebal.scheduler.grads import GradGroup, GradSync

    dense = [nn.Parameter(torch.zeros(64)) for _ in range(3)]
    experts = [nn.Parameter(torch.zeros(64)) for _ in range(2)]
    for p in experts:
        p._moebal_expert_param = True
    sched = CommScheduler("lina", timeout_s=10)
    try:
        groups = [GradGroup("dp_ep", [dense[0], dense[1], dense[2]], group=object(), divisor=2.0),
                  GradGroup("dp", experts, group=object(), divisor=2.0)]
        gs = GradSync(sched, groups, chunk_bytes=256)  # one chunk per parameter
        late = [any(getattr(gs.params[pid], "_moebal_expert_param", False) for pid in pids)
                for pids in gs._chunk_params]
        assert late == [False, False, False, True, True]
        # hook-fed chunks: last registered first (the order the backward pass finishes them)
        assert [gs.params[pids[0]] for pids in gs._chunk_params[:3]] == [dense[2], dense[1], dense[0]]
        gs.close()
    finally:
        sched.close()
