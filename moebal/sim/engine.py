"""Discrete-event engine: ops on per-rank streams, collectives as fluid flows sharing links.

Semantics (those of CUDA streams and NCCL communicators):
1. Every op runs on one stream of one rank; a stream runs its ops one after another in issue order.
2. An op is ready when the previous op of its stream and all its explicit dependencies are done.
3. A compute op then runs for its fixed duration.
4. A collective op waits until every member rank's op is ready (the slowest member sets the start), then
   runs its phases: each phase waits its latency, then moves its bytes as one fluid flow.
5. Link sharing is processor sharing: a link of capacity C carrying n flows gives each C / n; a flow moves at
   the rate its most constrained link allows (min over its links of C_l / n_l / bytes_l, in phase fractions
   per second). Rates are recomputed whenever a flow starts or ends on a shared link, so an all-to-all that
   overlaps an all-reduce on the same NIC is slowed, as Lina measured.
6. Priority gating (Lina): a `gated` collective is held on a rank while any `priority` collective is
   registered there (ready, running, or announced by the start of a compute op that precedes it).

Ranks are simulated individually; nothing here knows about models or parallel layouts (see sim/program.py).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moebal.planner.cost import Collective, Phase, Topology

__all__ = ["Engine", "EngineResult", "SimulationError"]

_COMPUTE, _LATENCY, _FLOW, _START = 0, 1, 2, 3
_MAX_STREAMS = 64
_WIDE = 64
"""Links from which a flow's rate is computed in numpy rather than in a Python loop: where the two cost the same
(one rate over 32 / 64 / 128 links: 8 / 15 / 28 us in the loop, 13.5 / 15.7 / 21 us in numpy, on a 2-vCPU EPYC)."""


class SimulationError(RuntimeError):
    """The op graph cannot finish (a dependency cycle or a collective some member never issues)."""


@dataclass
class EngineResult:
    """Per-op intervals and per-link bytes of one simulated run."""

    op_rank: np.ndarray
    op_stream: np.ndarray
    op_start: np.ndarray
    op_end: np.ndarray
    op_is_comm: np.ndarray
    op_name: list[str]
    op_cat: list[str]
    streams: list[str]
    link_bytes: np.ndarray
    num_ranks: int

    @property
    def makespan(self) -> float:
        return float(self.op_end.max()) if self.op_end.size else 0.0


class Engine:
    """Build an op graph with `compute` and `collective`, then `run` it."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.cap_L = topo.capacity_L
        self.streams: list[str] = []
        self._stream_idx: dict[str, int] = {}
        self._last: dict[int, int] = {}  # rank * _MAX_STREAMS + stream -> last op issued there
        # per-op columns
        self.rank: list[int] = []
        self.stream: list[int] = []
        self.dur: list[float] = []
        self.coll: list[int] = []
        self.ndeps: list[int] = []
        self.dependents: list[list[int]] = []
        self.name: list[str] = []
        self.cat: list[str] = []
        self.gated: set[int] = set()
        self.priority: set[int] = set()
        self.announce: dict[int, int] = {}  # compute op -> priority op it announces
        # per-collective columns
        self.c_ops: list[list[int]] = []
        self.c_phases: list[Collective] = []

    # ---- building ----
    def _stream(self, name: str) -> int:
        if name not in self._stream_idx:
            if len(self.streams) >= _MAX_STREAMS:
                raise ValueError(f"more than {_MAX_STREAMS} streams per rank")
            self._stream_idx[name] = len(self.streams)
            self.streams.append(name)
        return self._stream_idx[name]

    def _new_op(self, rank: int, stream: str, deps: Sequence[int], name: str, cat: str) -> int:
        return self._new_ops([rank], stream, [deps], name, cat)[0]

    def _new_ops(self, ranks: Sequence[int], stream: str, deps: Sequence[Sequence[int]] | None, name: str,
                 cat: str) -> list[int]:
        """Append one op per rank (the hot path of building: locals only, no per-op attribute lookups)."""
        s = self._stream(stream)
        last, ndeps, dependents = self._last, self.ndeps, self.dependents
        first = len(self.rank)
        n = len(ranks)
        self.rank.extend(ranks)
        self.stream.extend([s] * n)
        self.dur.extend([0.0] * n)
        self.coll.extend([-1] * n)
        self.name.extend([name] * n)
        self.cat.extend([cat] * n)
        dependents.extend([] for _ in range(n))
        ids = list(range(first, first + n))
        for i, r in enumerate(ranks):
            op = first + i
            k = 0
            if deps is not None:
                for d in deps[i]:
                    if d >= 0:
                        if d >= op:
                            raise ValueError(f"op {name!r} depends on op {d}, which does not exist yet")
                        dependents[d].append(op)
                        k += 1
            key = r * _MAX_STREAMS + s
            prev = last.get(key)
            if prev is not None:
                dependents[prev].append(op)
                k += 1
            last[key] = op
            ndeps.append(k)
        return ids

    def compute_many(self, ranks: Sequence[int], stream: str, durs: Sequence[float], name: str,
                     cat: str = "compute", deps: Sequence[Sequence[int]] | None = None) -> list[int]:
        """`compute` for several ranks at once (durs[i], deps[i] for ranks[i])."""
        if any(not d >= 0 for d in durs):
            raise ValueError(f"op {name!r}: durations must be >= 0 seconds")
        ids = self._new_ops(ranks, stream, deps, name, cat)
        self.dur[ids[0]:ids[0] + len(ids)] = [float(d) for d in durs]
        return ids

    def last_op(self, rank: int, stream: str) -> int:
        """The op issued last on (rank, stream), -1 when none."""
        s = self._stream_idx.get(stream)
        return -1 if s is None else self._last.get(rank * _MAX_STREAMS + s, -1)

    def add_dep(self, op: int, dep: int) -> None:
        """Make `op` wait for `dep` as well (wiring across stages after both exist)."""
        if not (0 <= op < len(self.rank) and 0 <= dep < len(self.rank)):
            raise ValueError(f"add_dep({op}, {dep}): no such op")
        self.ndeps[op] += 1
        self.dependents[dep].append(op)

    def compute(self, rank: int, stream: str, dur: float, name: str, cat: str = "compute",
                deps: Sequence[int] = ()) -> int:
        """A compute op of `dur` seconds; returns its id."""
        if not dur >= 0:
            raise ValueError(f"op {name!r}: duration must be >= 0 seconds; got {dur!r}")
        op = self._new_op(rank, stream, deps, name, cat)
        self.dur[op] = float(dur)
        return op

    def collective(self, coll: Collective, stream: str | Sequence[str], name: str, cat: str = "comm",
                   deps: Sequence[Sequence[int]] | None = None, gated: bool = False,
                   priority: bool = False) -> list[int]:
        """One op per member of `coll.ranks` (deps[i] for member i; `stream` one name or one per member);
        returns the member op ids."""
        c = len(self.c_ops)
        if isinstance(stream, str):
            ops = self._new_ops(coll.ranks, stream, deps, name, cat)
        else:
            ops = [self._new_op(r, stream[i], deps[i] if deps is not None else (), name, cat)
                   for i, r in enumerate(coll.ranks)]
        for op in ops:
            self.coll[op] = c
        if gated:
            self.gated.update(ops)
        if priority:
            self.priority.update(ops)
        self.c_ops.append(ops)
        self.c_phases.append(coll)
        return ops

    def announce_priority(self, compute_op: int, priority_op: int) -> None:
        """Register `priority_op` on its rank as soon as `compute_op` starts (Lina's look-ahead)."""
        self.announce[compute_op] = priority_op

    # ---- running ----
    def run(self) -> EngineResult:
        return _Run(self).go()


class _Run:
    """One execution of an Engine's graph (state kept apart so the graph can be run again)."""

    def __init__(self, g: Engine) -> None:
        self.g = g
        n_ops, n_coll = len(g.rank), len(g.c_ops)
        self.ndeps = list(g.ndeps)
        self.start = [np.nan] * n_ops
        self.end = [np.nan] * n_ops
        self.dep_t = [0.0] * n_ops
        self.arrived = [0] * n_coll
        self.c_start = [0.0] * n_coll
        self.phase = [0] * n_coll
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        num_ranks = g.topo.num_ranks
        self.prio = [0] * num_ranks
        self.held: list[list[int]] = [[] for _ in range(num_ranks)]
        self.registered = [False] * n_ops
        # Without priority gating nothing depends on the order compute ops finish in, so a compute op's end is
        # settled at once (no heap round trip); collectives still start in time order through the heap.
        self.eager = not g.gated and not g.announce
        self.work: list[tuple[int, float]] = []
        # flows: per-link state in Python lists (a flow touches a few dozen links; numpy's per-call overhead on
        # arrays that small was most of a flow's cost)
        L = g.topo.num_links
        self.n_L = [0] * L
        self.on_link: list[set[int]] = [set() for _ in range(L)]
        self.link_bytes = [0.0] * L
        self.f_of: dict[int, _PhaseFlow] = {}
        self.f_prog: dict[int, float] = {}
        self.f_rate: dict[int, float] = {}
        self.f_t: dict[int, float] = {}
        self.f_ver: dict[int, int] = {}
        self._phase_flows: dict[int, _PhaseFlow | None] = {}

    def push(self, t: float, kind: int, obj: int, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, ver))

    def go(self) -> EngineResult:
        g = self.g
        for op in range(len(g.rank)):
            if self.ndeps[op] == 0:
                self.ready(op, 0.0)
        self.settle()
        heap, work, pop = self.heap, self.work, heapq.heappop
        while heap:
            t, _, kind, obj, ver = pop(heap)
            if kind == _COMPUTE:
                self.done(obj, t)
            elif kind == _LATENCY:
                self.start_flow(obj, t)
            elif kind == _START:
                self.start_phase(obj, t)
            elif self.f_ver.get(obj) == ver:
                self.end_flow(obj, t)
            if work:
                self.settle()
        end = np.asarray(self.end)
        if np.isnan(end).any():
            self.deadlock(end)
        return EngineResult(op_rank=np.asarray(g.rank), op_stream=np.asarray(g.stream), op_start=np.asarray(self.start),
                            op_end=end, op_is_comm=np.asarray(g.coll) >= 0,
                            op_name=g.name, op_cat=g.cat, streams=list(g.streams),
                            link_bytes=np.asarray(self.link_bytes, dtype=np.float64),
                            num_ranks=g.topo.num_ranks)

    def deadlock(self, end: np.ndarray) -> None:
        g = self.g
        stuck = np.nonzero(np.isnan(end))[0][:5]
        desc = [f"{g.name[o]} on rank {g.rank[o]} "
                f"({f'waiting for {self.ndeps[o]} deps' if self.ndeps[o] else 'issued, waiting for peers'})"
                for o in stuck]
        raise SimulationError(f"{int(np.isnan(end).sum())} ops never finished, e.g. {'; '.join(desc)}: "
                              f"the op graph has a cycle or a collective not issued by every member")

    # ---- ops ----
    def ready(self, op: int, t: float) -> None:
        g = self.g
        c = g.coll[op]
        if c < 0:
            self.start[op] = t
            if self.eager:
                self.work.append((op, t + g.dur[op]))
                return
            pr = g.announce.get(op, -1)
            if pr >= 0:
                self.register(pr)
            self.push(t + g.dur[op], _COMPUTE, op)
            return
        if op in g.priority:
            self.register(op)
        r = g.rank[op]
        if op in g.gated and self.prio[r] > 0:
            self.held[r].append(op)
            return
        self.arrive(op, t)

    def register(self, op: int) -> None:
        if not self.registered[op]:
            self.registered[op] = True
            self.prio[self.g.rank[op]] += 1

    def arrive(self, op: int, t: float) -> None:
        c = self.g.coll[op]
        self.arrived[c] += 1
        if t > self.c_start[c]:
            self.c_start[c] = t
        if self.arrived[c] == len(self.g.c_ops[c]):
            t = self.c_start[c]  # the slowest member (eager arrivals come out of time order)
            for o in self.g.c_ops[c]:
                self.start[o] = t
            if self.eager:
                self.push(t, _START, c)  # eager arrivals may run ahead of the clock: start in time order
            else:
                self.start_phase(c, t)

    def settle(self) -> None:
        work = self.work
        while work:
            op, t = work.pop()
            self.done(op, t)

    def done(self, op: int, t: float) -> None:
        g = self.g
        self.end[op] = t
        if self.registered[op]:
            r = g.rank[op]
            self.prio[r] -= 1
            if self.prio[r] == 0 and self.held[r]:
                held, self.held[r] = self.held[r], []
                for h in held:
                    if self.prio[r] == 0:
                        self.arrive(h, t)
                    else:
                        self.held[r].append(h)
        ndeps, at, coll = self.ndeps, self.dep_t, g.coll
        for d in g.dependents[op]:
            ndeps[d] -= 1
            if t > at[d]:
                at[d] = t
            if ndeps[d] == 0:  # ready at its latest dependency's end (eager ends come out of time order)
                if self.eager and coll[d] < 0:  # `ready` of an eager compute op, inline (most ops are these)
                    td = self.start[d] = at[d]
                    self.work.append((d, td + g.dur[d]))
                else:
                    self.ready(d, at[d])

    # ---- collectives and flows ----
    def start_phase(self, c: int, t: float) -> None:
        phases = self.g.c_phases[c].phases
        k = self.phase[c]
        if k >= len(phases):
            for o in self.g.c_ops[c]:
                self.done(o, t)
            return
        lat = phases[k].latency_s
        if lat > 0:
            self.push(t + lat, _LATENCY, c)
        else:
            self.start_flow(c, t)

    def flow_of(self, ph: Phase) -> _PhaseFlow | None:
        """A phase's links that carry bytes, with what a flow over them needs (None: no bytes to move). Phases
        are shared by the micro-batches that repeat a collective, so each is prepared once."""
        key = id(ph)  # the phase lives as long as the engine's graph, so its id stays its own
        if key in self._phase_flows:
            return self._phase_flows[key]
        keep = ph.nbytes > 0
        links = ph.links[keep]
        fl = None
        if links.size:
            if np.unique(links).size != links.size:
                raise ValueError("a collective phase lists a link twice; its bytes must be summed per link")
            demand = ph.nbytes[keep] / ph.efficiency
            cap = np.asarray(self.g.cap_L, dtype=np.float64)[links]
            fl = _PhaseFlow(links=links.tolist(), nbytes=ph.nbytes[keep].tolist(), demand=demand.tolist(),
                            cap=cap.tolist(), solo_rate=float(np.min(cap / demand)),
                            wide=(operator.itemgetter(*links.tolist()), cap, demand) if links.size >= _WIDE else None)
        self._phase_flows[key] = fl
        return fl

    def start_flow(self, c: int, t: float) -> None:
        fl = self.flow_of(self.g.c_phases[c].phases[self.phase[c]])
        if fl is None:
            self.phase[c] += 1
            self.start_phase(c, t)
            return
        n_L, on_link, link_bytes = self.n_L, self.on_link, self.link_bytes
        affected: set[int] = set()
        for link, nbytes in zip(fl.links, fl.nbytes):
            link_bytes[link] += nbytes
            n_L[link] += 1
            s = on_link[link]
            if s:
                affected |= s
            s.add(c)
        self.f_of[c] = fl
        self.f_prog[c] = 0.0
        self.f_t[c] = t
        self.f_rate[c] = 0.0
        self.f_ver[c] = 0
        if not affected:  # alone on every link it uses: its rate is the phase's own, known in advance
            self.f_rate[c] = fl.solo_rate
            self.f_ver[c] = 1
            self.push(t + 1.0 / fl.solo_rate, _FLOW, c, 1)
            return
        affected.add(c)
        self.rerate(affected, t)

    def end_flow(self, c: int, t: float) -> None:
        fl = self.f_of.pop(c)
        for d in (self.f_prog, self.f_rate, self.f_t, self.f_ver):
            d.pop(c)
        n_L, on_link = self.n_L, self.on_link
        affected: set[int] = set()
        for link in fl.links:
            n_L[link] -= 1
            s = on_link[link]
            s.discard(c)
            if s:
                affected |= s
        if affected:
            self.rerate(affected, t)
        self.phase[c] += 1
        self.start_phase(c, t)

    def rerate(self, flows: set[int], t: float) -> None:
        """Each flow's rate: the min over its links of capacity / (flows on the link x its demand there)."""
        n_L = self.n_L
        for f in flows:
            fl = self.f_of[f]
            prog = self.f_prog[f] + self.f_rate[f] * (t - self.f_t[f])
            if fl.wide is None:
                rate = min(cap / (n_L[link] * demand) for link, cap, demand in zip(fl.links, fl.cap, fl.demand))
            else:  # a wide collective (a data-parallel all-reduce crosses every node): the same figure in numpy
                counts, cap_a, demand_a = fl.wide
                n = np.fromiter(counts(n_L), dtype=np.float64, count=len(fl.links))
                rate = float(np.min(cap_a / (n * demand_a)))
            self.f_prog[f], self.f_t[f], self.f_rate[f] = prog, t, rate
            self.f_ver[f] += 1
            remaining = max(0.0, 1.0 - prog)
            self.push(t + remaining / rate, _FLOW, f, self.f_ver[f])


@dataclass(frozen=True)
class _PhaseFlow:
    """A collective phase as a flow: its links (those carrying bytes, each once), the bytes and demand (bytes /
    efficiency) per link, each link's capacity, and its rate when no other flow shares its links."""

    links: list[int]
    nbytes: list[float]
    demand: list[float]
    cap: list[float]
    solo_rate: float
    wide: tuple[Callable[[list[int]], tuple[int, ...]], np.ndarray, np.ndarray] | None
    """For a phase of at least `_WIDE` links: what reads its links' flow counts from the engine's list at once,
    and its capacities and demands as arrays."""
