"""Planning ahead: micro-batch plans for the next iterations are computed in background worker processes
while the current iteration trains, and handed to every rank in iteration order.

DynaPipe plans on CPU cores next to the GPUs and pushes each executor's instructions to a store (Redis in the
paper). Here, on one job:
  1. every rank reads the same global batches (the samplers are deterministic), `lookahead` iterations
     ahead of the one training; global rank 0 submits each batch's sample lengths to a pool of `workers`
     spawned processes (`concurrent.futures.ProcessPoolExecutor`; the planner imports no torch, so a worker
     starts in a fraction of a second and the cost table is sent to it once, at start; a later table comes
     with the jobs planned on it, so a migration keeps the workers);
  2. a publisher thread on rank 0 takes the finished plans *in iteration order* and writes each as JSON to a
     `torch.distributed.TCPStore` hosted by rank 0 (key `mbplan/<generation>/<step>`);
  3. at step s every rank reads `mbplan/<generation>/<s>` (a blocking get: the only place training can wait on
     planning); rank 0 deletes the key of step s - 2, which every rank has read (the pipeline's reductions order
     the steps).
A re-pack changes the number of stages, and the plans made ahead (an instruction stream per stage) no longer
fit: every rank still training calls `replan` at the same point of the same step, which starts a new
generation, and the planning rank plans the steps read ahead again on the new cost table. A plan of the old
generation that finishes later is published under its own generation's key, which no rank reads.
`workers = 0` plans inline on rank 0 when the step asks for its plan (all of the planning is exposed; for
tests and comparison). A failed plan is published as an error, so no rank hangs: every rank raises it.
The time each rank waits in `get` is the exposed planning time it reports (`plan_wait_s`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import timedelta
from typing import Any

from moebal.errors import ConfigError
from moebal.planner.microbatch import MicroBatchPlan, plan_microbatches
from moebal.planner.microbatch_cost import MicroBatchCost

__all__ = ["PlanAhead", "plan_json"]

_WORKER: dict[str, Any] = {}


def _init_worker(cost: dict[str, Any], kwargs: dict[str, Any], parent_pid: int) -> None:
    _WORKER["costs"] = {0: MicroBatchCost.from_dict(cost)}
    _WORKER["kwargs"] = kwargs
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="moebal-plan-parent-watch", daemon=True).start()


def _exit_with_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit when the rank that started this worker is gone. A rank that dies without shutting its pool down
    (killed by the launcher after another rank failed, or SIGKILL) sends its idle workers no sentinel, and an
    idle worker holds both ends of its own call queue, so it would wait forever -- keeping the job's stdout and
    stderr pipes open, which hangs whatever reads them to EOF (the launcher's caller, a test)."""
    while os.getppid() == parent_pid:
        time.sleep(period_s)
    os._exit(0)


Scale = list[float] | None
"""Per-stage factors on the cost table's times for one plan (a dynamism scheme's prediction: `stage_scale`)."""


def plan_json(lengths: Sequence[int], cost: MicroBatchCost, kwargs: dict[str, Any], scale: Scale = None) -> str:
    """One plan as JSON, or 'ERROR:<message>' (published so every rank raises it); the table's times scaled by
    `scale` first."""
    try:
        return plan_microbatches(lengths, cost.scaled(scale), **kwargs).to_json()
    except ConfigError as e:
        return f"ERROR:{e}"


def _worker_plan(lengths: list[int], scale: Scale, version: int = 0, cost: dict[str, Any] | None = None) -> str:
    """One plan in a worker, on table `version`: the pool's first (sent once, at start) or a later one, which
    comes with the jobs planned on it (`cost`) and is kept for the next ones (two versions at most)."""
    costs: dict[int, MicroBatchCost] = _WORKER["costs"]
    table = costs.get(version)
    if table is None:
        assert cost is not None, f"table version {version} came without its table"
        table = costs[version] = MicroBatchCost.from_dict(cost)
        for old in sorted(costs)[:-2]:
            del costs[old]
    return plan_json(lengths, table, _WORKER["kwargs"], scale)


class PlanAhead:
    """The plan of step s, on every rank; rank 0 plans (in workers) and publishes through a TCPStore."""

    def __init__(self, cost: MicroBatchCost | None, kwargs: dict[str, Any], *, workers: int = 1,
                 store: Any = None, is_planner: bool = True, timeout_s: float = 600.0) -> None:
        self.kwargs, self.workers, self.is_planner = dict(kwargs), workers, is_planner
        self.store, self.timeout_s = store, timeout_s
        self.cost = cost
        self._version = 0  # the table's version: the pool's first is 0
        self._sent: dict[str, Any] | None = None  # a later version's table, sent with its jobs
        self.generation = 0
        """Bumped by `replan` on every rank alike: the plans of a generation are keyed apart."""
        self._pending: dict[int, Future[str] | tuple[list[int], Scale]] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._out: queue.Queue[tuple[int, int, Future[str] | tuple[list[int], Scale]] | None] = queue.Queue()
        self._local: dict[tuple[int, int], str] = {}
        self._stored: set[tuple[int, int]] = set()
        """(generation, step) of the plans in the store (planning rank): a replan deletes the old generation's."""
        self._lock = threading.Condition()
        self._publisher: threading.Thread | None = None
        if is_planner:
            if cost is None:
                raise ConfigError("the planning rank needs a cost table")
            self._start_pool()
            self._publisher = threading.Thread(target=self._publish, name="moebal-plan-publisher", daemon=True)
            self._publisher.start()

    def _start_pool(self) -> None:
        if self.workers > 0 and self.cost is not None:
            import multiprocessing

            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker,
                                             initargs=(self.cost.to_dict(), self.kwargs, os.getpid()))

    def set_cost(self, cost: MicroBatchCost) -> None:
        """Plan the steps submitted from now on with `cost` (the layers moved); plans already submitted finish
        on the table they were submitted with. The workers stay: each job of a new table carries it (a few KB;
        a worker keeps the latest two), where starting a new pool would make the step after a migration wait
        for a spawned interpreter."""
        if not self.is_planner:
            return
        self.cost = cost
        self._version += 1
        self._sent = cost.to_dict()

    @classmethod
    def for_job(cls, cost: MicroBatchCost | None, kwargs: dict[str, Any], workers: int) -> PlanAhead:
        """Collective over the default process group: rank 0 hosts the store on a port the kernel picks (bound at
        once, so no other job can take it first), tells the others."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        host: list[tuple[str, int] | None] = [None]
        store = None
        if rank == 0:
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            store = dist.TCPStore(addr, 0, world, is_master=True, timeout=timedelta(seconds=600),
                                  wait_for_workers=False)
            host = [(addr, store.port)]
        dist.broadcast_object_list(host, src=0)
        if rank != 0:
            assert host[0] is not None  # filled in by rank 0's broadcast
            addr, port = host[0]
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=600))
        return cls(cost, kwargs, workers=workers, store=store, is_planner=rank == 0)

    def replan(self, cost: MicroBatchCost, steps: Sequence[tuple[int, Sequence[int]]], scale: Scale = None) -> None:
        """A new generation (every rank, at the same point): the planning rank plans `steps` (each a step and its
        sample lengths, in increasing order: the batches read ahead) again with `cost` (times `scale`); their old
        plans, and any still being made, are never read."""
        if not self.is_planner:
            self.generation += 1
            return
        with self._lock:  # a plan of the old generation finishing from now on is dropped (`_put`)
            self.generation += 1
            old = sorted(self._stored)
            self._stored.clear()
            self._local.clear()  # the old generation's plans made ahead
        if self.store is not None:  # every rank has read the plans of the steps it trained: the rest is unread
            for gen, step in old:
                self.store.delete_key(f"mbplan/{gen}/{step}")
        self._pending.clear()
        self.set_cost(cost)
        for step, lengths in steps:
            self.submit(step, lengths, scale)

    # ---- rank 0: submit and publish ----
    def submit(self, step: int, lengths: Sequence[int], scale: Scale = None) -> None:
        """Queue the plan of `step` (planner rank only; steps in increasing order), costed on the table's times
        times `scale` (per stage; None: as they are)."""
        if not self.is_planner:
            return
        lengths = [int(x) for x in lengths]
        job: Future[str] | tuple[list[int], Scale] = (
            self._pool.submit(_worker_plan, lengths, scale, self._version, self._sent) if self._pool
            else (lengths, scale))
        self._pending[step] = job
        self._out.put((self.generation, step, job))

    def _publish(self) -> None:
        while True:
            item = self._out.get()
            if item is None:
                return
            gen, step, job = item
            if isinstance(job, tuple):  # inline planning: done when the step asks (see get)
                continue
            try:
                text = job.result()
            except Exception as e:  # noqa: BLE001 - a dead worker must not hang the other ranks
                text = f"ERROR:planning worker failed: {e.__class__.__name__}: {e}"
            self._put(gen, step, text)

    def _put(self, gen: int, step: int, text: str) -> None:
        """Publish the plan of `step` in generation `gen`; one of an older generation than the current (it
        finished after a replan) is dropped: no rank reads it, and a store key nobody deletes would stay for the
        job's life (a migration replans, and a long job migrates often)."""
        with self._lock:
            if gen < self.generation:
                return
            self._local[(gen, step)] = text
            if self.store is not None:
                self._stored.add((gen, step))
                self.store.set(f"mbplan/{gen}/{step}", text)
            self._lock.notify_all()

    # ---- every rank ----
    def get(self, step: int) -> tuple[MicroBatchPlan, float]:
        """The plan of `step` and the seconds this call waited for it (exposed planning time)."""
        t0 = time.perf_counter()
        if self.is_planner:
            job = self._pending.pop(step, None)
            if job is None:
                raise RuntimeError(f"no plan was submitted for step {step}")  # programmer error
            key = (self.generation, step)
            if isinstance(job, tuple):
                if self.cost is None:  # programmer error: the runner sets the cost model before planning
                    raise RuntimeError(f"no micro-batch cost model to plan step {step} with: call set_cost first")
                self._put(*key, plan_json(job[0], self.cost, self.kwargs, job[1]))
            with self._lock:
                if not self._lock.wait_for(lambda: key in self._local, timeout=self.timeout_s):
                    raise RuntimeError(f"the plan of step {step} took longer than {self.timeout_s:.0f} s")
                text = self._local.pop(key)
            if self.store is not None and step >= 3:
                with self._lock:
                    self._stored.discard((self.generation, step - 2))
                self.store.delete_key(f"mbplan/{self.generation}/{step - 2}")
        else:
            raw = self.store.get(f"mbplan/{self.generation}/{step}")
            text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        wait = time.perf_counter() - t0
        if text.startswith("ERROR:"):
            raise ConfigError(f"micro-batch plan of step {step}: {text[len('ERROR:'):]}")
        return MicroBatchPlan.from_dict(json.loads(text)), wait

    def close(self) -> None:
        """Stop publishing and planning: queued plans are cancelled, and the pool's workers and manager thread
        have exited when this returns. A pool left winding down at the interpreter's exit races CPython 3.11's
        exit hook (`concurrent.futures.process._python_exit` writes to the wakeup pipe that the pool's manager
        thread is closing without a common lock): EBADF, and a rank that trained to the end exits 1."""
        if self._publisher is not None:
            self._out.put(None)
            self._publisher.join(timeout=5)
            self._publisher = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
