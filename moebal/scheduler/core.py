"""One communication scheduler per rank: it issues every collective of a training step, by priority.

Two kinds of work (Lina, ATC'23, section 4.3; thesis chapter 4):

- critical collectives (all-to-all dispatch and combine and their count exchange, Trans, the routing
  statistics): the compute thread needs their result soon. They are issued at once, from the compute thread,
  and never wait for anything (`issue` / `run`);
- background collectives (gradient all-reduce chunks): nobody waits for them until the optimizer step. They
  are queued in one fixed order and a scheduler thread issues them: under Lina's rule a chunk is issued only
  while no critical collective is queued or in flight on this rank and no all-to-all is announced
  (`expect_critical`, the look-ahead signal of the backward combine), with at most `inflight` chunks in
  flight. Agg (replica gradients back to their owners) is issued by the compute thread like a critical
  collective but does not hold the chunks back: only the optimizer step waits for it.

Why an all-to-all never waits for an in-flight chunk (the thesis leaves it open; it reads as "wait"): each rank
gates its own chunks, so rank A may hold chunk k back (its all-to-all is queued) while rank B has already issued
it. If B's all-to-all then waited for its chunk k to finish, B would wait for A's chunk k, A for its all-to-all,
and the all-to-all for B: a deadlock. So an arriving all-to-all runs at once and shares the links with at most
`inflight` chunks (one by default), which bounds the contention the way the thesis intends.

Forecast (`predict`, lina): the look-ahead above is an exact signal but a late one: a chunk issued a moment
before the announcement is still on the link when the all-to-all arrives (a chunk in flight is not pre-empted).
The backward pass issues the same critical collectives in the same order every step, with gaps that change
little, so the scheduler reads the last step's event log (`Forecast`): after the critical collective that just
finished, when was the next one queued, and how long did a chunk of this size hold the link. A chunk that
would still be in flight at the predicted arrival is held until the collective is queued (then the usual rule
applies) or until the prediction has clearly failed (a quarter of the chunk's time after the predicted
arrival), so a wrong forecast costs bounded link idle time and never correctness or a deadlock (holding is
what the look-ahead already does; an all-to-all never waits for a chunk).

Every rank issues the chunks of one channel in the same order (the order is fixed at start-up, not the order
in which hooks fire), and the chunks run on communicators the scheduler alone uses, so the ranks always agree
on which collective comes next whatever the compute threads do on the other groups meanwhile.

Modes: "lina" (gated chunks), "ddp" (the unscheduled baseline: buckets issued as soon as they are ready,
concurrent with the all-to-alls, as PyTorch DDP does), "off" (no thread: the gradients are reduced in one
collective per group after the backward pass, the behaviour without a scheduler).

The device decides, once, how completions are observed (`completion_for`): on CPU (gloo) a collective's
future calls back when it is done and point-to-point transfers are waited for by a waiter thread; on CUDA
(NCCL) the scheduler's channels use high-priority streams for the critical collectives and a waiter thread
polls completion events, since an NCCL handle's wait() returns before the transfer ends. Everything else is
the same code.

Failures: a collective that fails (a peer died, a timeout of the channel's `timeout_s`, a bad launch) is stored
and raised in the compute thread at its next call into the scheduler, and waits on the scheduler give up after
`timeout_s` with a message naming the operation, so a broken job stops on every rank instead of hanging.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moebal.distributed.dilate import DeviceClock
from moebal.scheduler.events import CRITICAL, CommEvent, EventLog

__all__ = ["MODES", "BackgroundOp", "CommScheduler", "Completion", "Forecast", "Handle", "SchedulerError",
           "completion_for"]

MODES = ("off", "ddp", "lina")

Works = Any  # a torch.distributed Work, a list of them, or None (nothing to wait for)


class SchedulerError(RuntimeError):
    """A collective failed or did not finish in time; raised on the compute thread."""


def _as_list(works: Works) -> list[Any]:
    if works is None:
        return []
    return list(works) if isinstance(works, (list, tuple)) else [works]


# ---- how completion is observed ------------------------------------------------------------------------------
class Completion:
    """Calls `callback(error_or_None)` once every work of an issued operation has finished, or at the first one
    that fails (with its error; the others may still be running: fail fast)."""

    device_type = "cpu"
    """The device whose collectives this strategy observes (`CommScheduler` refuses another pairing)."""
    stream_wait = False
    """`Handle.wait` is a stream wait (each work's wait() on the compute thread: the compute stream waits for
    the communication stream, the host does not), not a host wait for the completion callback."""

    def watch(self, works: Sequence[Any], callback: Callable[[BaseException | None], None]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop helper threads (idempotent)."""


class _Waiter(threading.Thread):
    """A daemon thread that waits for queued works in order (blocking waits) or polls them (poll_s > 0)."""

    def __init__(self, poll_s: float, device: torch.device | None = None) -> None:
        super().__init__(name="moebal-comm-waiter", daemon=True)
        self.poll_s, self.device = poll_s, device
        self.q: queue.Queue[Any] = queue.Queue()
        self.start()

    def run(self) -> None:
        _set_thread_device(self.device)
        watching: list[tuple[list[Any], Callable[[BaseException | None], None]]] = []
        while True:
            try:
                item = self.q.get(timeout=self.poll_s if (watching and self.poll_s) else None)
                if item is None:
                    return
                watching.append(item)
            except queue.Empty:
                pass
            if not self.poll_s:  # blocking: finish the oldest before looking at the next
                works, cb = watching.pop(0)
                cb(_wait_all(works))
                continue
            still = []
            for works, cb in watching:
                try:
                    if all(w.is_completed() for w in works):
                        cb(_wait_all(works))
                    else:
                        still.append((works, cb))
                except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                    cb(e)
            watching = still

    def stop(self) -> None:
        self.q.put(None)


def _set_thread_device(device: torch.device | None) -> None:
    """A helper thread's current CUDA device is device 0 until it says otherwise: anything it launches or
    allocates (an NCCL work's events, a collective issued from the scheduler thread) must be on the rank's."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def _wait_all(works: Sequence[Any]) -> BaseException | None:
    try:
        for w in works:
            w.wait()
    except BaseException as e:  # noqa: BLE001 - handed to the compute thread
        return e
    return None


class HostCompletion(Completion):
    """CPU (gloo): future callbacks for collectives; a waiter thread for point-to-point works (no futures)."""

    def __init__(self) -> None:
        self._waiter: _Waiter | None = None

    def watch(self, works: Sequence[Any], callback: Callable[[BaseException | None], None]) -> None:
        works = list(works)
        if not works:
            callback(None)
            return
        futures = []
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:  # gloo send/recv works have no future
            if self._waiter is None:
                self._waiter = _Waiter(poll_s=0.0)
            self._waiter.q.put((works, callback))
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one(fut: Any) -> None:
            err = None
            try:
                fut.value()
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                err = e
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if err is not None or last:
                callback(err)

        for f in futures:
            f.add_done_callback(one)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None


class PollingCompletion(Completion):
    """CUDA (NCCL): a waiter thread polls each work's completion event (`is_completed`), which is what the
    scheduler's gate needs (is a critical collective still on the link?); the compute thread never waits for
    it: `Handle.wait` is a stream wait (an NCCL work's wait() only orders the compute stream after the
    communication stream)."""

    device_type = "cuda"
    stream_wait = True

    def __init__(self, poll_s: float = 50e-6, device: torch.device | None = None) -> None:
        self._waiter = _Waiter(poll_s=poll_s, device=device)

    def watch(self, works: Sequence[Any], callback: Callable[[BaseException | None], None]) -> None:
        if not works:
            callback(None)
            return
        self._waiter.q.put((list(works), callback))

    def close(self) -> None:
        self._waiter.stop()


def completion_for(device: torch.device) -> Completion:
    """The completion strategy for the job's device, chosen once at start-up."""
    return PollingCompletion(device=device) if device.type == "cuda" else HostCompletion()


def _check_stream_concurrency(device: torch.device, mode: str) -> None:
    """Refuse the one setting under which overlapped collectives on several communicators can deadlock.

    With mode ddp or lina a rank's gradient chunks and its critical collectives run on different
    communicators, and the ranks issue them in different orders (each rank gates its own chunks). NCCL
    tolerates that only while the kernels of the two communicators can run side by side: each communicator has
    its own stream, and at most `inflight` chunks plus one critical collective are in flight. With
    CUDA_DEVICE_MAX_CONNECTIONS=1 every stream feeds one hardware queue, so rank A's chunk kernel (waiting for
    its peer) can sit in front of the all-to-all kernel its peer is waiting for: a deadlock. docs/scheduler.md."""
    if device.type == "cuda" and mode != "off" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ValueError(f"scheduler.mode={mode} overlaps collectives on several NCCL communicators in an order "
                         f"that differs between ranks, which can deadlock when CUDA_DEVICE_MAX_CONNECTIONS=1 puts "
                         f"every stream in one hardware queue: unset CUDA_DEVICE_MAX_CONNECTIONS or use "
                         f"scheduler.mode=off")


# ---- operations ----------------------------------------------------------------------------------------------
class Handle:
    """A collective issued by the compute thread; `wait()` blocks until it completes.

    The wait is on the completion callback, never a second `work.wait()`: gloo's point-to-point works count
    the waits on a receive buffer, so a second wait on a receive would wait for a message that never comes."""

    def __init__(self, sched: CommScheduler, event: CommEvent, works: list[Any]) -> None:
        self.sched, self.event, self.works = sched, event, works
        self.done = False
        self.error: BaseException | None = None
        self._evt = threading.Event()

    def wait(self) -> None:
        """CPU: block until the collective completed (or failed, or `timeout_s` passed). CUDA: order the compute
        stream after it and return at once (no host sync; the NCCL watchdog enforces the process group's
        timeout, and a failure seen by the waiter thread is raised at the next call into the scheduler)."""
        s = self.sched
        if s.completion.stream_wait:
            for w in self.works:
                w.wait()
            s.check()
            return
        t = time.perf_counter()
        deadline = t + s.timeout_s
        try:
            while not self._evt.wait(timeout=min(max(deadline - time.perf_counter(), 0.0), 1.0)):
                if s._error is not None:
                    break
                if time.perf_counter() >= deadline:
                    err = TimeoutError(f"not complete after {s.timeout_s:g}s; a peer rank may have failed or "
                                       f"stopped issuing collectives")
                    s._fail(err, self.event)
                    raise SchedulerError(s._describe(self.event, err))
        finally:
            s.log.span("blocked", self.event.name, t)
            s.clock.mark()  # waiting is not device time
        if self.error is not None:
            raise SchedulerError(s._describe(self.event, self.error)) from self.error
        s.check()


class BackgroundOp:
    """One background collective (a gradient chunk): `launch()` issues it asynchronously and returns its work."""

    def __init__(self, kind: str, name: str, nbytes: int, launch: Callable[[], Any], group: str = "",
                 chunk: int = -1) -> None:
        self.kind, self.name, self.nbytes, self.launch = kind, name, nbytes, launch
        self.group, self.chunk = group, chunk
        self.ready = False
        self.event: CommEvent | None = None
        self.works: list[Any] | None = None
        """What `launch()` returned, once issued."""
        self.done = False


def _keys(events: Sequence[CommEvent]) -> list[tuple[str, int]]:
    """(name, occurrence) of each event: names repeat within a step ("routing stats" once per layer)."""
    seen: dict[str, int] = {}
    out = []
    for e in events:
        out.append((e.name, seen.get(e.name, 0)))
        seen[e.name] = seen.get(e.name, 0) + 1
    return out


class Forecast:
    """The last step's timing, read as a forecast of this one (module docstring, "Forecast").

    `next_critical`: when the next critical collective will be queued, as the gap the last step had between
    the finish of the same critical collective (same name, same occurrence) and the queueing of its successor;
    before the step's first critical collective, the gap from the step's start. `wire`: how long a gradient
    chunk of `nbytes` holds the link, from the last step's chunks of the same communicator (median seconds per
    byte of the chunks at least half as large). None where the last step says nothing (first step, a name
    that did not occur: e.g. another number of token chunks), and then nothing is held."""

    def __init__(self, t0: float, events: Sequence[CommEvent]) -> None:
        crit = sorted((e for e in events if e.kind in CRITICAL and e.done), key=lambda e: e.queued)
        self.first = crit[0].queued - t0 if crit else None
        self.gap = {k: nxt.queued - e.finished for k, e, nxt in zip(_keys(crit), crit, crit[1:])}
        self.chunks: dict[str, list[tuple[int, float]]] = {}
        for e in events:
            if e.kind == "allreduce" and e.done and not math.isnan(e.started) and e.nbytes > 0:
                self.chunks.setdefault(e.group, []).append((e.nbytes, e.finished - e.started))

    def next_critical(self, t0: float, current: Sequence[CommEvent]) -> float | None:
        """Predicted queue time of the next critical collective, given this step's so far (`current`, in
        queue order, the last one finished)."""
        if not current:
            return None if self.first is None else t0 + self.first
        last = current[-1]
        gap = self.gap.get(_keys(current)[-1])
        return None if gap is None or not last.done else last.finished + gap

    def wire(self, group: str, nbytes: int) -> float | None:
        xs = [d / b for b, d in self.chunks.get(group, ()) if b >= nbytes / 2]
        return nbytes * statistics.median(xs) if xs else None


class CommScheduler:
    """Issues a rank's collectives by priority (see the module docstring)."""

    def __init__(self, mode: str = "lina", *, rank: int = 0, device: torch.device | str = "cpu",
                 completion: Completion | None = None, log: EventLog | None = None, inflight: int = 1,
                 lookahead: bool = True, predict: bool = True, timeout_s: float = 120.0,
                 dilate: float = 1.0) -> None:
        if mode not in MODES:
            raise ValueError(f"scheduler mode must be one of {', '.join(MODES)}; got {mode!r}")
        if inflight < 1:
            raise ValueError(f"scheduler inflight must be >= 1; got {inflight}")
        self.mode, self.rank, self.device = mode, rank, torch.device(device)
        self.completion = completion or completion_for(self.device)
        if self.completion.device_type != self.device.type:
            # A host completion on NCCL would report a collective done when it is only enqueued, and a reader
            # of its result (the count exchange's split sizes) would read uninitialised memory.
            raise ValueError(f"{type(self.completion).__name__} observes {self.completion.device_type} "
                             f"collectives, this scheduler's device is {self.device}: use completion_for(device)")
        _check_stream_concurrency(self.device, mode)
        self.log = log or EventLog(rank)
        self.window = inflight if mode == "lina" else math.inf
        self.use_lookahead = lookahead and mode == "lina"
        self.use_forecast = predict and mode == "lina"
        self._forecast: Forecast | None = None
        self._draining = False
        self.held_s = 0.0
        """Time this step's chunks were held on the forecast (the scheduler thread's view)."""
        self.timeout_s = timeout_s
        self.clock = DeviceClock(dilate)
        """Emulated devices `dilate` x slower than a core (a CPU benchmark device, `moebal.distributed.dilate`): the
        compute thread's span before each collective, gradient hand-off and wait lasts `dilate` x its CPU time."""
        self._cond = threading.Condition(threading.RLock())
        self._critical = 0  # critical collectives queued or in flight
        self._lookahead = False
        self._seq: list[BackgroundOp] = []
        self._next = 0  # next background op to issue
        self._inflight = 0
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if mode != "off":
            # Started after the process groups exist and were warmed up (ParallelDims.init): this thread issues
            # on the scheduler's own channels only, so two threads never create a communicator at once.
            self._thread = threading.Thread(target=self._loop, name=f"moebal-comm-scheduler-{rank}", daemon=True)
            self._thread.start()

    # ---- critical path (compute thread) ----
    def issue(self, kind: str, launch: Callable[[], Works], *, name: str, nbytes: int, layer: int = -1,
              chunk: int = -1, group: str = "") -> Handle:
        """Issue a collective now; its completion is observed in the background, `wait()` blocks on it."""
        self.check()
        self.clock.settle()
        critical = kind in CRITICAL
        with self._cond:
            ev = self.log.event(kind, name, nbytes, layer=layer, chunk=chunk, group=group)
            if critical:
                self._critical += 1
                # a chunk held on the forecast wakes now: rule 2 blocks it from here, and the hold (`held_s`,
                # what the forecast costs) ends; it slept to its hold's end, logging the queued collective's time
                self._cond.notify_all()
            if kind == "a2a":  # the announced all-to-all is here: the look-ahead has done its job
                self._lookahead = False
            ev.started = ev.queued
        try:
            works = _as_list(launch())
        except BaseException as e:
            self._fail(e, ev)
            raise SchedulerError(self._describe(ev, e)) from e
        h = Handle(self, ev, works)
        self.completion.watch(works, lambda err: self._critical_done(h, err))
        return h

    def run(self, kind: str, launch: Callable[[], Works], **kw: Any) -> None:
        """Issue a collective and wait for it (a blocking collective through the scheduler)."""
        self.issue(kind, launch, **kw).wait()

    # ---- the collectives moebal's parallel code issues ----
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None, group: Any, *, name: str, layer: int = -1, chunk: int = -1,
                   kind: str = "a2a") -> Handle:
        """Uneven all_to_all_single along dim 0, issued now (async); splits None: even."""
        inp = inp.contiguous()
        return self.issue(kind, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                                                async_op=True),
                          name=name, nbytes=inp.numel() * inp.element_size(), layer=layer, chunk=chunk)

    def all_reduce(self, t: torch.Tensor, group: Any, *, name: str, kind: str = "stats",
                   op: Any = None) -> torch.Tensor:
        """Blocking all-reduce (in place) through the scheduler; returns t."""
        reduce_op = dist.ReduceOp.SUM if op is None else op
        self.run(kind, lambda: dist.all_reduce(t, op=reduce_op, group=group, async_op=True), name=name,
                 nbytes=t.numel() * t.element_size())
        return t

    def p2p(self, ops: Sequence[Any], *, kind: str, name: str, layer: int = -1) -> Handle:
        """A batch of point-to-point transfers (Trans, Agg), issued now (async)."""
        nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in ops)
        return self.issue(kind, lambda: dist.batch_isend_irecv(list(ops)) if ops else None, name=name,
                          nbytes=nbytes, layer=layer)

    def expect_critical(self) -> None:
        """Lina's look-ahead: an all-to-all is about to be issued (the backward combine started); hold chunks
        until it is. Only the all-to-all ends the hold: the routing statistics' backward all-reduce that the
        backward pass often issues between the announcement and the all-to-all is critical too, and when it
        ended the hold a chunk slipped onto the link a millisecond before the all-to-all and shared it."""
        if self.use_lookahead:
            with self._cond:
                self._lookahead = True

    def _critical_done(self, h: Handle, err: BaseException | None) -> None:
        with self._cond:
            if err is not None:
                h.error = err
                self._fail(err, h.event)
            if h.done:
                return
            h.done = True
            h.event.finished = time.perf_counter()
            if h.event.kind in CRITICAL:
                self._critical -= 1
            self._cond.notify_all()
        h._evt.set()

    # ---- the compute thread's device time (dilation) ----
    def start_compute(self) -> None:
        """The compute thread starts a span of device work (after waiting outside the scheduler: a barrier)."""
        self.clock.mark()

    def settle(self) -> None:
        """The compute thread reached a point other ranks see outside the scheduler (the step's end)."""
        self.clock.settle()

    # ---- background work ----
    def begin_step(self, ops: Sequence[BackgroundOp]) -> None:
        """The step's background ops, in the one order every rank issues them."""
        self.check()
        with self._cond:
            if any(not self._settled(op) for op in self._seq):
                raise SchedulerError("begin_step while the previous step's gradient chunks are still pending")
            # `_inflight` carries over: with stream waits (CUDA) the last step's chunks may still be on the link,
            # and they count against the window until the waiter thread sees them finish.
            self._seq, self._next, self._lookahead = list(ops), 0, False
            self._draining, self.held_s = False, 0.0
            self._forecast = Forecast(*self.log.previous) if self.use_forecast else None
            for op in self._seq:
                op.ready, op.done, op.event, op.works = False, False, None, None

    def ready(self, index: int) -> None:
        """Background op `index` may be issued (its gradients are complete)."""
        self.clock.settle()  # the device produced the gradients only now
        with self._cond:
            op = self._seq[index]
            if not op.ready:
                op.ready = True
                op.event = self.log.event(op.kind, op.name, op.nbytes, chunk=op.chunk, group=op.group)
                self._cond.notify_all()

    def drain(self) -> None:
        """Block until every background op of the step has completed (before the optimizer step). On CUDA:
        until every op has been issued, then the compute stream waits for them (the host does not)."""
        self.clock.settle()
        with self._cond:  # nothing critical comes before the optimizer step: no hold any more
            self._lookahead, self._draining = False, True
            self._cond.notify_all()
        if self.mode == "off":
            self._issue_inline()
        t = time.perf_counter()
        deadline = t + self.timeout_s
        try:
            with self._cond:
                while self._error is None and not all(self._settled(op) for op in self._seq):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise SchedulerError(self._stuck())
                    self._cond.wait(timeout=min(left, 1.0))
        finally:
            self.log.span("blocked", "gradient all-reduce", t)
            self.clock.mark()
        self.check()
        if self.completion.stream_wait:
            for op in self._seq:
                for w in op.works or ():
                    w.wait()

    def _settled(self, op: BackgroundOp) -> bool:
        """Nothing more for the host to wait for: done, or (stream waits) issued."""
        return op.done or (self.completion.stream_wait and op.works is not None)

    def _issue_inline(self) -> None:
        """Mode off: issue every op from the compute thread, one after the other (no overlap)."""
        self._next = len(self._seq)
        for op in self._seq:
            if op.event is None:
                op.ready = True
                op.event = self.log.event(op.kind, op.name, op.nbytes, chunk=op.chunk, group=op.group)
            op.event.started = time.perf_counter()
            self._inflight += 1
            works = op.works = _as_list(op.launch())
            err = _wait_all(works)
            self._background_done(op, err)
            self.check()

    def _can_issue(self) -> bool:
        if self._next >= len(self._seq) or self._inflight >= self.window:
            return False
        if not self._seq[self._next].ready:
            return False
        return self.mode != "lina" or (self._critical == 0 and not self._lookahead)

    def _hold_s(self) -> float:
        """How long to hold the next chunk on the forecast (0: issue it now). Held when it would still be in
        flight at the predicted arrival of the next critical collective, until that arrival plus a quarter of
        the chunk's time (then the forecast has failed and holding longer would only idle the link)."""
        f = self._forecast
        if f is None or self._draining:
            return 0.0
        op = self._seq[self._next]
        w = f.wire(op.group, op.nbytes)
        q = f.next_critical(self.log.t0, self.log.critical_so_far()) if w is not None else None
        if q is None or w is None:
            return 0.0
        now = time.perf_counter()
        return q + w / 4 - now if now + w > q and now < q + w / 4 else 0.0

    def _loop(self) -> None:
        _set_thread_device(self.device)
        while True:
            with self._cond:
                while not self._stop:
                    if self._error is None and self._can_issue():
                        hold = self._hold_s()
                        if hold <= 0:
                            break
                        t = time.perf_counter()
                        self._cond.wait(timeout=hold)  # a critical collective queued meanwhile takes over
                        self.held_s += time.perf_counter() - t
                        self.log.span("held", self._seq[self._next].name, t)
                    else:
                        self._cond.wait()
                if self._stop:
                    return
                op = self._seq[self._next]
                self._next += 1
                self._inflight += 1
                assert op.event is not None
                # Issued under the lock: a critical collective queued from now on is queued after this start,
                # so the event log shows exactly what the rule decided.
                op.event.started = time.perf_counter()
                try:
                    works = _as_list(op.launch())
                except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                    self._background_done(op, e)
                    continue
                op.works = works
                self._cond.notify_all()
            self.completion.watch(works, functools.partial(self._background_done, op))

    def _background_done(self, op: BackgroundOp, err: BaseException | None) -> None:
        with self._cond:
            if err is not None and op.event is not None:
                self._fail(err, op.event)
            if not op.done:
                op.done = True
                if op.event is not None:
                    op.event.finished = time.perf_counter()
                self._inflight -= 1
            self._cond.notify_all()

    # ---- failures ----
    def _fail(self, err: BaseException, ev: CommEvent) -> None:
        with self._cond:
            if self._error is None:
                self._error = SchedulerError(self._describe(ev, err))
                self._error.__cause__ = err
            self._cond.notify_all()

    def _describe(self, ev: CommEvent, err: BaseException) -> str:
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return (f"rank {self.rank}: {ev.kind} collective '{ev.name}' ({ev.nbytes} bytes, step {self.log.step}) "
                f"failed: {first}")

    def _stuck(self) -> str:
        pending = [op for op in self._seq if not op.done]
        op = pending[0]
        state = "in flight" if op.event is not None and not math.isnan(op.event.started) else "not issued"
        return (f"rank {self.rank}: {len(pending)} of {len(self._seq)} gradient all-reduce chunks did not finish "
                f"within {self.timeout_s:g}s (first: '{op.name}', {state}); a peer rank may have failed or stopped "
                f"issuing collectives")

    def check(self) -> None:
        """Raise the first failure seen by the scheduler thread or a completion callback."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.completion.close()
