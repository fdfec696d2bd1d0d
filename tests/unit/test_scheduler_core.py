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


class _TimedWork:
    """A collective's work that completes `seconds` after launch (what a chunk on a slow link looks like)."""

    def __init__(self, seconds: float) -> None:
        self.fut: torch.futures.Future = torch.futures.Future()
        threading.Timer(seconds, lambda: self.fut.set_result(None)).start()

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def wait(self) -> None:
        self.fut.wait()


def _slow_chunk(seconds: float) -> BackgroundOp:
    return BackgroundOp("allreduce", "dp_ep allreduce 0", 1 << 20, lambda: _TimedWork(seconds), group="dp_ep",
                        chunk=0)


def _backward_like_step(sched: CommScheduler, step: int, gap_s: float, chunk_s: float, all_to_all: bool = True):
    """Statistics all-reduce, chunk ready, `gap_s` later an (unannounced) all-to-all (or none), then the
    optimizer's drain; the step's events."""
    sched.log.begin(step)
    sched.begin_step([_slow_chunk(chunk_s)])
    sched.run("stats", lambda: None, name="balancing loss bwd", nbytes=64)
    sched.ready(0)
    time.sleep(gap_s)
    if all_to_all:
        sched.issue("a2a", lambda: _TimedWork(0.05), name="L0 combine0 bwd", nbytes=4096).wait()
    sched.drain()
    return {e.name: e for e in sched.log.events}


def test_forecast_holds_a_chunk_that_would_meet_the_next_all_to_all():
    """The last step showed an all-to-all 0.3 s after the statistics all-reduce and a chunk that holds the link
    for 0.4 s: from the second step on, a chunk ready right after the statistics waits for the all-to-all
    instead of sharing the link with it; without the forecast (or on the first step) it goes at once."""
    sched = CommScheduler("lina", timeout_s=10)
    try:
        first = _backward_like_step(sched, 1, 0.3, 0.4)
        assert first["dp_ep allreduce 0"].started < first["L0 combine0 bwd"].queued  # nothing to predict from
        second = _backward_like_step(sched, 2, 0.3, 0.4)
        chunk, a2a = second["dp_ep allreduce 0"], second["L0 combine0 bwd"]
        assert chunk.started >= a2a.finished, "the chunk met the all-to-all the last step predicted"
        assert sched.held_s > 0.2
        comm = sched.log.end()  # the event log shows the hold too: a span of the chunk, in the step's held_s
        assert {s.name for s in comm.spans if s.cat == "held"} == {"dp_ep allreduce 0"}
        assert abs(comm.held_s - sched.held_s) < 1e-3 and comm.metrics()["held_s"] > 0.2
        # a forecast that fails (no all-to-all this time) holds for a bounded time only: arrival + chunk / 4
        third = _backward_like_step(sched, 3, 0.6, 0.4, all_to_all=False)
        waited = third["dp_ep allreduce 0"].started - third["balancing loss bwd"].finished
        assert 0.2 < waited < 0.3 + 0.1 + 0.15, waited
    finally:
        sched.close()
    plain = CommScheduler("lina", predict=False, timeout_s=10)
    try:
        _backward_like_step(plain, 1, 0.3, 0.4)
        ev = _backward_like_step(plain, 2, 0.3, 0.4)
        assert ev["dp_ep allreduce 0"].started < ev["L0 combine0 bwd"].queued
    finally:
        plain.close()


def test_a_hold_ends_when_the_all_to_all_is_queued_early():
    """The forecast said 0.3 s; the all-to-all comes at 0.1 s and runs 0.5 s. The chunk's hold (`held_s`: what the
    forecast costs in link idle time) ends when the all-to-all is queued, where rule 2 takes over; the chunk still
    starts after it. The hold slept to its own end (0.4 s), so `held_s` counted the all-to-all's time too."""
    sched = CommScheduler("lina", timeout_s=10)
    try:
        _backward_like_step(sched, 1, 0.3, 0.4)  # teaches: the all-to-all 0.3 s after the statistics
        sched.log.end()
        sched.log.begin(2)
        sched.begin_step([_slow_chunk(0.4)])
        sched.run("stats", lambda: None, name="balancing loss bwd", nbytes=64)
        sched.ready(0)
        time.sleep(0.1)
        sched.issue("a2a", lambda: _TimedWork(0.5), name="L0 combine0 bwd", nbytes=4096).wait()
        sched.drain()
        comm = sched.log.end()
        ev = {e.name: e for e in comm.events}
        chunk, a2a = ev["dp_ep allreduce 0"], ev["L0 combine0 bwd"]
        held = [sp for sp in comm.spans if sp.cat == "held"]
        assert held and chunk.started >= a2a.finished
        assert max(sp.end for sp in held) < a2a.queued + 0.15, (max(sp.end for sp in held) - a2a.queued)
        assert comm.held_s < 0.25, comm.held_s
    finally:
        sched.close()


def test_forecast_lets_a_chunk_go_that_finishes_before_the_next_all_to_all():
    """A chunk much shorter than the gap is issued at once: the forecast only holds what would overlap."""
    sched = CommScheduler("lina", timeout_s=10)
    try:
        _backward_like_step(sched, 1, 0.4, 0.05)
        ev = _backward_like_step(sched, 2, 0.4, 0.05)
        chunk, a2a = ev["dp_ep allreduce 0"], ev["L0 combine0 bwd"]
        assert chunk.finished < a2a.queued and sched.held_s == 0.0
    finally:
        sched.close()


def test_every_rank_of_an_exchange_issues_the_planned_chunk_count():
    """Each chunk is one all-to-all of the whole group: a rank with fewer rows than chunks on every link sends
    empty chunks rather than falling back to fewer collectives than its peers (which would pair them wrongly)."""
    from moebal.scheduler.exchange import ExchangePlan

    # 2 ranks, 2 experts (one each), 2 chunks: rank 0 sends itself 5 rows and rank 1 one; rank 1 one row each way
    plans = [ExchangePlan(send_counts=[[5, 0], [0, 1]], recv_counts=[[5, 0], [1, 0]], local=[0], chunks=2,
                          device=torch.device("cpu")),
             ExchangePlan(send_counts=[[1, 0], [0, 1]], recv_counts=[[0, 1], [0, 1]], local=[1], chunks=2,
                          device=torch.device("cpu"))]
    assert [p.chunks for p in plans] == [2, 2] and [len(p.parts) for p in plans] == [2, 2]
    # the rows still add up: every row goes out once over the chunks
    assert [sum(sum(c.send) for c in p.parts) for p in plans] == [6, 2]
