"""The per-step log of every collective a rank issues, what its compute thread waited for, and its Chrome trace.

Times are `time.perf_counter()` seconds (CLOCK_MONOTONIC on Linux: one clock for every process of a machine,
so the ranks of a single-machine job line up in one trace; ranks on other machines are shifted by their
clocks' offset, which the trace does not correct).

An event is one collective (or one chunk of one): `queued` when it was handed to the scheduler, `started`
when it was issued to the communication library, `finished` when the library reported it complete. A span
is an interval of the compute thread: `blocked` spans are where it waited on communication (their sum is the
step's exposed communication time), other spans (forward, backward, experts, optimizer) give the trace its
compute track.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moebal.fileio import write_text_whole

__all__ = ["CRITICAL", "CommEvent", "EventLog", "Span", "StepComm", "check_order", "chrome_trace", "step_record",
           "write_chrome_trace"]

CRITICAL = ("a2a", "counts", "trans", "stats")
"""Kinds on the critical path: gradient all-reduce chunks wait while one of these is queued or in flight."""


@dataclass
class CommEvent:
    """One collective (or one chunk of one) on one rank."""

    kind: str
    """a2a | counts | trans | agg | stats | allreduce."""
    name: str
    nbytes: int
    queued: float
    started: float = math.nan
    finished: float = math.nan
    layer: int = -1
    chunk: int = -1
    group: str = ""

    @property
    def done(self) -> bool:
        return not math.isnan(self.finished)

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        d = asdict(self)
        for k in ("queued", "started", "finished"):
            d[k] = None if math.isnan(d[k]) else round(d[k] - t0, 7)
        return d


@dataclass
class Span:
    """An interval of the compute thread: `cat` is blocked (waiting on `name`) or a compute phase; or of the
    scheduler thread: `cat` held, a ready gradient chunk `name` held back on the forecast."""

    cat: str
    name: str
    start: float
    end: float

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        return {"cat": self.cat, "name": self.name, "start": round(self.start - t0, 7),
                "end": round(self.end - t0, 7)}


@dataclass
class StepComm:
    """What one step's communication cost this rank (seconds)."""

    step: int
    step_s: float
    exposed_s: float
    """Compute thread blocked on communication."""
    a2a_s: float
    """Time with at least one all-to-all (or count exchange) in flight, issue to completion, concurrent token
    chunks counted once, less the time the experts computed meanwhile (the overlap token chunks buy): the
    all-to-all's share of the critical path, whether the compute thread waited for it or did other work."""
    allreduce_s: float
    """Time with at least one gradient all-reduce chunk in flight."""
    placement_s: float
    """Time with at least one Trans or Agg in flight."""
    a2a_shared_s: float
    """Time with an all-to-all (or count exchange) and a gradient all-reduce chunk in flight together: how long
    the critical exchange shared the links with gradient sync (what Lina's priority removes)."""
    held_s: float
    """Time a ready gradient chunk was held back on the forecast (lina's `predict`; the link may idle meanwhile)."""
    collectives: int
    bytes: int
    events: list[CommEvent] = field(default_factory=list, repr=False)
    spans: list[Span] = field(default_factory=list, repr=False)
    t0: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"exposed_comm_s": round(self.exposed_s, 6), "a2a_s": round(self.a2a_s, 6),
                "allreduce_s": round(self.allreduce_s, 6), "placement_comm_s": round(self.placement_s, 6),
                "a2a_shared_s": round(self.a2a_shared_s, 6), "held_s": round(self.held_s, 6)}


class EventLog:
    """Events and spans of the current step (thread-safe: the scheduler thread and callbacks record too)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.step = 0
        self.t0 = time.perf_counter()
        self.events: list[CommEvent] = []
        self.spans: list[Span] = []
        self.previous: tuple[float, list[CommEvent]] = (self.t0, [])
        """The last step's start and events (the scheduler predicts the current step's collectives from them)."""
        self._lock = threading.Lock()

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def begin(self, step: int) -> None:
        with self._lock:
            if self.events:
                self.previous = (self.t0, self.events)
            self.step, self.t0 = step, time.perf_counter()
            self.events, self.spans = [], []

    def critical_so_far(self) -> list[CommEvent]:
        """The current step's critical collectives, in the order they were queued."""
        with self._lock:
            return [e for e in self.events if e.kind in CRITICAL]

    def event(self, kind: str, name: str, nbytes: int, *, layer: int = -1, chunk: int = -1,
              group: str = "") -> CommEvent:
        ev = CommEvent(kind=kind, name=name, nbytes=int(nbytes), queued=time.perf_counter(), layer=layer,
                       chunk=chunk, group=group)
        with self._lock:
            self.events.append(ev)
        return ev

    def span(self, cat: str, name: str, start: float, end: float | None = None) -> None:
        with self._lock:
            self.spans.append(Span(cat, name, start, time.perf_counter() if end is None else end))

    def end(self) -> StepComm:
        """Close the step and summarise it (the events stay available until the next `begin`)."""
        t1 = time.perf_counter()
        with self._lock:
            events, spans = list(self.events), list(self.spans)

        def spans_of(kinds: Sequence[str]) -> list[tuple[float, float]]:
            return [(e.started, e.finished) for e in events if e.kind in kinds and e.done]

        def busy(kinds: Sequence[str]) -> float:
            return _union_len(spans_of(kinds))

        a2a = spans_of(("a2a", "counts"))
        experts = [(x.start, x.end) for x in spans if x.cat == "compute" and " experts" in x.name]
        hidden = _intersection_len(a2a, experts)
        ar = spans_of(("allreduce",))

        def of_cat(cat: str) -> float:
            return _union_len([(s.start, s.end) for s in spans if s.cat == cat])

        return StepComm(step=self.step, step_s=t1 - self.t0, exposed_s=of_cat("blocked"),
                        a2a_s=busy(("a2a", "counts")) - hidden, allreduce_s=_union_len(ar),
                        placement_s=busy(("trans", "agg")), a2a_shared_s=_intersection_len(a2a, ar),
                        held_s=of_cat("held"), collectives=len(events), bytes=sum(e.nbytes for e in events),
                        events=events, spans=spans, t0=self.t0)


def _union_len(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals (blocked spans may nest: a wait inside a wait counts once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_len(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of (union of a) n (union of b): |A n B| = |A| + |B| - |A u B|."""
    return _union_len(a) + _union_len(b) - _union_len([*a, *b])


def step_record(comm: StepComm, rank: int) -> dict[str, Any]:
    """One line of the event log file: the step's summary, its events and spans, times relative to its start."""
    return {"step": comm.step, "rank": rank, "t0": comm.t0, "step_s": round(comm.step_s, 6), **comm.metrics(),
            "events": [e.to_dict(comm.t0) for e in comm.events], "spans": [s.to_dict(comm.t0) for s in comm.spans]}


def chrome_trace(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace (chrome://tracing, Perfetto) of step records from any number of ranks: one process per
    rank; threads: compute (phases), waits (blocked spans), and one track per collective kind."""
    t_min = min((r["t0"] for r in records), default=0.0)
    out: list[dict[str, Any]] = []
    tracks = {"compute": 0, "blocked": 1, "a2a": 2, "counts": 2, "stats": 3, "trans": 4, "agg": 5, "allreduce": 6,
              "held": 8}
    names = {0: "compute", 1: "waits on communication", 2: "all-to-all", 3: "stats", 4: "Trans", 5: "Agg",
             6: "gradient all-reduce", 8: "gradient chunks held (forecast)"}
    for r in records:
        pid, shift = r["rank"], (r["t0"] - t_min) * 1e6
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}})
        for tid, label in names.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        for s in r["spans"]:
            tid = {"blocked": 1, "held": 8}.get(s["cat"], 0)
            out.append({"ph": "X", "pid": pid, "tid": tid, "name": s["name"], "cat": s["cat"],
                        "ts": shift + s["start"] * 1e6, "dur": max(0.0, (s["end"] - s["start"]) * 1e6)})
        for e in r["events"]:
            if e["started"] is None:
                continue
            tid = tracks.get(e["kind"], 7)
            end = e["finished"] if e["finished"] is not None else e["started"]
            args = {"bytes": e["nbytes"], "queued_us": round(e["queued"] * 1e6, 1),
                    "waited_to_start_us": round((e["started"] - e["queued"]) * 1e6, 1)}
            out.append({"ph": "X", "pid": pid, "tid": tid, "name": e["name"], "cat": e["kind"],
                        "ts": shift + e["started"] * 1e6, "dur": max(0.0, (end - e["started"]) * 1e6), "args": args})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    return write_text_whole(path, json.dumps(chrome_trace(records)))


def check_order(record: dict[str, Any], lina: bool = True) -> None:
    """Assert, from one step record of the event log, what the scheduler promises; AssertionError otherwise.

    - every collective finished;
    - (lina) no gradient all-reduce chunk started while a critical collective (all-to-all, count exchange,
      Trans, routing statistics) was queued or in flight on this rank;
    - Trans of a layer finished before that layer's first expert computation;
    - every Agg finished before the optimizer step (a compute span named "optimizer", when recorded).
    """
    events, spans = record["events"], record["spans"]
    for e in events:
        assert e["finished"] is not None, f"{e['name']} never finished"
    if lina:
        critical = [(e["queued"], e["finished"], e["name"]) for e in events if e["kind"] in CRITICAL]
        for e in events:
            if e["kind"] != "allreduce":
                continue
            s = e["started"]
            for q, f, name in critical:
                assert not (q <= s < f), (f"step {record['step']} rank {record['rank']}: {e['name']} started at "
                                          f"{s:.6f} while {name} was queued/in flight [{q:.6f}, {f:.6f})")
    first_experts: dict[int, float] = {}
    for s in spans:
        if s["cat"] == "compute" and s["name"].startswith("L") and " experts" in s["name"] and "bwd" not in s["name"]:
            layer = int(s["name"][1:].split()[0])
            first_experts[layer] = min(first_experts.get(layer, float("inf")), s["start"])
    for e in events:
        if e["kind"] == "trans" and e["layer"] in first_experts:
            assert e["finished"] <= first_experts[e["layer"]], (
                f"step {record['step']} rank {record['rank']}: {e['name']} finished at {e['finished']:.6f}, after "
                f"layer {e['layer']}'s experts started at {first_experts[e['layer']]:.6f}")
    opt = [s["start"] for s in spans if s["name"] == "optimizer"]
    if opt:
        for e in events:
            if e["kind"] == "agg":
                assert e["finished"] <= opt[0], (f"step {record['step']} rank {record['rank']}: {e['name']} "
                                                 f"finished after the optimizer step started")
