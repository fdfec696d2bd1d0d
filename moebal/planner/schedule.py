"""Pipeline schedules as data: the ordered forward/backward operations of one stage, and a replay.

Shape legend: P = stages, M = micro-batches.

A schedule is a list of `(kind, micro_batch)` with kind "F" (forward), "B" (backward) or "W" (weight
gradients). GPipe and 1F1B have no W: their B computes every gradient. They are deadlock-free under the
engine's communication rule (every send is non-blocking, every receive blocks): a stage's receive for F(j)
waits only on F(j) upstream, its receive for B(j) only on B(j) downstream, and B(j) on the last stage
follows F(j) on that same stage, so the wait graph is acyclic.

Zero bubble ("zb", after Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): B(j) computes only what the
previous stage waits for (gradients of activations, and of the parameters outside Linear layers), and W(j)
later computes the Linear weight gradients of micro-batch j (half of a Linear layer's backward GEMMs, no
communication). A W can be put where a stage would otherwise wait, so the pipeline's warm-up and drain
bubbles shrink. The order is not a fixed pattern but generated (`zero_bubble`): a greedy replay of all
stages on unit times (F = B = W, the paper's assumption) in which a free stage runs, by priority, the next
B whose gradient has arrived, else the next F whose input has arrived, else its oldest pending W. A
micro-batch holds memory on stage p from its F to its W, and at most P - p of them may (1F1B's bound for
activations), so a stage runs a W before an F when the bound is reached. The per-stage orders come from
one feasible global timeline, so executing them with blocking receives cannot deadlock, whatever the real
times. Settled here, not in the paper: the paper's ZB-H1 is a hand-made pattern and ZB-H2/auto need a
solver and optimizer-step rollback; the greedy rule gives ZB-H1's memory bound with no solver.

`simulate` replays per-stage schedules on given per-micro-batch times (the same rule, no communication
cost unless given) and is what the planner's predicted iteration time and the Gantt charts of a plan use. A
given transfer time is spent as the simulator spends it (`moebal.sim.pipeline`, on the same engine rules as
`moebal.sim.program`): queued behind the previous transfer of its boundary and direction, and sharing a stage's
port with the transfer going the other way through it, so the replay equals the simulator for any transfer
size (`tests/unit/test_replay_against_simulator.py`).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from moebal.errors import ConfigError

__all__ = ["SCHEDULES", "W_SHARE", "Op", "TimedOp", "gpipe", "make_schedule", "one_f_one_b", "simulate",
           "zero_bubble"]

Op = tuple[str, int]


def _check(num_stages: int, stage: int, num_micro: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ConfigError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if num_micro < 1:
        raise ConfigError(f"the number of micro-batches must be at least 1; got {num_micro}")


def gpipe(num_stages: int, stage: int, num_micro: int) -> list[Op]:
    """GPipe: every forward, then every backward (activations of all M micro-batches live at once)."""
    _check(num_stages, stage, num_micro)
    return [("F", j) for j in range(num_micro)] + [("B", j) for j in range(num_micro)]


def one_f_one_b(num_stages: int, stage: int, num_micro: int, order: Sequence[int] | None = None) -> list[Op]:
    """1F1B (PipeDream-flush): P - p - 1 warm-up forwards, then alternate one forward and one backward,
    then drain; at most P - p micro-batches' activations are alive on stage p. Micro-batches are injected in
    `order` (a permutation of range(num_micro); None: 0, 1, ...). The one 1F1B order of the project: the
    engine, the adaptive schedule and the simulator all call it."""
    _check(num_stages, stage, num_micro)
    ids = list(range(num_micro)) if order is None else list(order)
    if sorted(ids) != list(range(num_micro)):
        raise ConfigError(f"order must be a permutation of range({num_micro}); got {ids}")
    warm = min(num_stages - stage - 1, num_micro)
    ops: list[Op] = [("F", ids[j]) for j in range(warm)]
    for j in range(num_micro - warm):
        ops += [("F", ids[warm + j]), ("B", ids[j])]
    ops += [("B", ids[j]) for j in range(num_micro - warm, num_micro)]
    return ops


def zero_bubble(num_stages: int, stage: int, num_micro: int) -> list[Op]:
    """Stage `stage`'s F / B / W order under the zero-bubble rule (see the module docstring)."""
    _check(num_stages, stage, num_micro)
    return list(_zero_bubble_orders(num_stages, num_micro)[stage])


@functools.cache
def _zero_bubble_orders(P: int, M: int) -> tuple[tuple[Op, ...], ...]:
    f_end: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> time its F ends (unit times: integers)
    b_end: dict[tuple[int, int], int] = {}
    nf, nb, nw = [0] * P, [0] * P, [0] * P  # F, B, W done per stage (each in micro-batch order)
    clock = [0] * P
    orders: list[list[Op]] = [[] for _ in range(P)]

    def choice(p: int) -> str | None:
        now = clock[p]
        if nb[p] < nf[p]:
            j = nb[p]
            arrived = f_end[(p, j)] if p == P - 1 else b_end.get((p + 1, j))
            if arrived is not None and arrived <= now:
                return "B"
        if nf[p] < M and nf[p] - nw[p] < min(P - p, M):
            arrived = 0 if p == 0 else f_end.get((p - 1, nf[p]))
            if arrived is not None and arrived <= now:
                return "F"
        return "W" if nw[p] < nb[p] else None

    while any(nw[p] < M for p in range(P)):
        live = [p for p in range(P) if nw[p] < M]
        now = min(clock[p] for p in live)
        ready = [p for p in live if clock[p] == now and choice(p) is not None]
        if not ready:  # every stage at `now` waits: move them to the next moment anything ends
            later = [t for t in (*f_end.values(), *b_end.values(), *(clock[p] for p in live)) if t > now]
            assert later, "zero-bubble generation deadlocked"  # programmer invariant: some op is always running
            for p in live:
                if clock[p] == now:
                    clock[p] = min(later)
            continue
        for p in ready:
            kind = choice(p)
            assert kind is not None
            done = (nf if kind == "F" else nb if kind == "B" else nw)
            j = done[p]
            orders[p].append((kind, j))
            done[p] += 1
            clock[p] += 1
            if kind == "F":
                f_end[(p, j)] = clock[p]
            elif kind == "B":
                b_end[(p, j)] = clock[p]
    return tuple(tuple(o) for o in orders)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble}

W_SHARE = 0.5
"""Share of a backward that is W under "zb" when nothing measured says otherwise (a Linear layer's backward is
two equal GEMMs, one of them W; attention cores, norms and activations have no W, so measured shares run
lower: 0.16 for a dense layer of the pipeline benchmark's GPT in bf16 on one CPU thread, 0.26 in fp32). The
runner replays with each stage's measured share once a "zb" iteration has been profiled."""


def make_schedule(name: str, num_stages: int, stage: int, num_micro: int) -> list[Op]:
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, stage, num_micro)


def in_flight(name: str, num_stages: int, stage: int, num_micro: int) -> int:
    """Most micro-batches whose activations a stage holds at once (for the memory model): from F to B, or
    to W where the schedule has W (the inputs and output gradients of Linear layers wait for it)."""
    ops = make_schedule(name, num_stages, stage, num_micro)
    release = "W" if any(kind == "W" for kind, _ in ops) else "B"
    alive = peak = 0
    for kind, _ in ops:
        alive += 1 if kind == "F" else -1 if kind == release else 0
        peak = max(peak, alive)
    return peak


@dataclass(frozen=True)
class TimedOp:
    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float


Times = Sequence[Sequence[float]] | Sequence[float]


def simulate(name: str, fwd: Times, bwd: Times, num_micro: int, comm_s: float = 0.0,
             w_share: float | Sequence[float] = W_SHARE) -> tuple[float, list[TimedOp]]:
    """(makespan, ops) of one iteration; `fwd[p]`/`bwd[p]` are stage p's per-micro-batch times (a number, or
    one per micro-batch). A backward time of 0 means the stage has nothing to differentiate (frozen). Under a
    schedule with W ops, stage p's B takes (1 - w_share[p]) of its backward time and W the rest (one number
    for every stage, or one per stage).

    Each stage-to-stage transfer (an activation forward, a gradient back) takes `comm_s` on its own and is
    queued as the simulator (`moebal.sim.pipeline`, `moebal.sim.program`) queues it: the transfers of one
    boundary and direction run one at a time in micro-batch order (one stream per direction), and transfers
    that overlap on a stage's outgoing port (its forward send and its backward send) or on its incoming port
    (the activation from upstream and the gradient from downstream) share it equally (processor sharing: each
    moves at 1 / n of its speed while n share a port, its speed the slowest of its two ports'). `ops` are the
    compute ops only, in the order they end."""
    P = len(fwd)
    if len(bwd) != P:
        raise ConfigError(f"fwd has {P} stages but bwd has {len(bwd)}")
    shares = [float(w_share)] * P if isinstance(w_share, (int, float)) else [float(x) for x in w_share]
    if len(shares) != P or not all(0.0 <= x <= 1.0 for x in shares):
        raise ConfigError(f"w_share must be one number in [0, 1] or one per stage ({P}); got {w_share!r}")
    if not comm_s >= 0:
        raise ConfigError(f"comm_s must be >= 0 seconds; got {comm_s!r}")
    return _Replay(name, fwd, bwd, num_micro, float(comm_s), shares).run()


class _Replay:
    """The event replay behind `simulate`: compute ops in each stage's schedule order, transfers as flows."""

    def __init__(self, name: str, fwd: Times, bwd: Times, num_micro: int, comm_s: float,
                 shares: list[float]) -> None:
        self.P, self.fwd, self.bwd, self.comm_s, self.shares = len(fwd), fwd, bwd, comm_s, shares
        self.scheds = [make_schedule(name, self.P, p, num_micro) for p in range(self.P)]
        self.has_w = [any(kind == "W" for kind, _ in sched) for sched in self.scheds]
        self.pos, self.busy = [0] * self.P, [False] * self.P
        self.arrived: set[tuple[str, int, int]] = set()  # (kind, stage, micro-batch) whose input is there
        self.heap: list[tuple[float, int, int, int]] = []  # (time, seq, what: -1 - stage | flow id, version)
        self.seq = 0
        self.out: list[TimedOp] = []
        self.running: list[tuple[str, int, float]] = [("", 0, 0.0)] * self.P  # (kind, micro-batch, start)
        # transfers: one queue per (sender, direction +1 / -1), flows on ports
        self.queue: dict[tuple[int, int], list[int]] = {}
        self.sending: set[tuple[int, int]] = set()
        self.flows: dict[int, _Flow] = {}
        self.on_out: list[set[int]] = [set() for _ in range(self.P)]
        self.on_in: list[set[int]] = [set() for _ in range(self.P)]
        self.next_id = 0

    def dur(self, p: int, kind: str, j: int) -> float:
        def at(x: Sequence[float] | float) -> float:
            return float(x) if isinstance(x, (int, float)) else float(x[j])

        if kind == "F":
            return at(self.fwd[p])
        share = self.shares[p] if self.has_w[p] else 0.0  # W ops exist only where the schedule has them
        return at(self.bwd[p]) * (share if kind == "W" else 1.0 - share)

    def push(self, t: float, what: int, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, what, ver))

    def run(self) -> tuple[float, list[TimedOp]]:
        for p in range(self.P):
            self.try_start(p, 0.0)
        while self.heap:
            t, _, what, ver = heapq.heappop(self.heap)
            if what < 0:
                self.compute_done(-1 - what, t)
            elif what in self.flows and self.flows[what].version == ver:
                self.flow_done(what, t)
        # programmer invariant: every schedule here is acyclic
        assert all(self.pos[p] == len(self.scheds[p]) for p in range(self.P)), "schedule deadlocked"
        return max((o.end for o in self.out), default=0.0), self.out

    def try_start(self, p: int, t: float) -> None:
        if self.busy[p] or self.pos[p] >= len(self.scheds[p]):
            return
        kind, j = self.scheds[p][self.pos[p]]
        # F waits for the activation from upstream, B for the gradient from downstream; the last stage's B
        # follows its own F (earlier in its order), W its own B
        needs = (kind == "F" and p > 0) or (kind == "B" and p < self.P - 1)
        if needs and (kind, p, j) not in self.arrived:
            return
        self.busy[p] = True
        self.running[p] = (kind, j, t)
        self.push(t + self.dur(p, kind, j), -1 - p)

    def compute_done(self, p: int, t: float) -> None:
        kind, j, start = self.running[p]
        self.out.append(TimedOp(p, kind, j, start, t))
        self.busy[p] = False
        self.pos[p] += 1
        d = 1 if kind == "F" else -1
        if kind != "W" and 0 <= p + d < self.P:
            if self.comm_s == 0.0:
                self.arrive(p + d, kind, j, t)
            else:  # a stage's sends of one kind leave in micro-batch order in every schedule here: the order
                # the simulator issues each stream's transfers in
                self.queue.setdefault((p, d), []).append(j)
                self.try_send(p, d, t)
        self.try_start(p, t)

    def arrive(self, q: int, kind: str, j: int, t: float) -> None:
        self.arrived.add((kind, q, j))
        self.try_start(q, t)

    # ---- transfers ----
    def try_send(self, p: int, d: int, t: float) -> None:
        """Start the next transfer of (stage p, direction d) when none of that stream is in flight."""
        q = self.queue.get((p, d))
        if not q or (p, d) in self.sending:
            return
        self.sending.add((p, d))
        f = self.next_id
        self.next_id += 1
        self.flows[f] = fl = _Flow(p, d, q.pop(0), self.comm_s, since=t)
        touched = self.on_out[p] | self.on_in[p + d]
        self.on_out[p].add(f)
        self.on_in[p + d].add(f)
        if not touched:  # alone on both ports: its own time, as a pure delay
            fl.version = 1
            self.push(t + self.comm_s, f, 1)
            return
        self.rerate(touched | {f}, t)

    def flow_done(self, f: int, t: float) -> None:
        fl = self.flows.pop(f)
        p, q = fl.sender, fl.sender + fl.direction
        self.on_out[p].discard(f)
        self.on_in[q].discard(f)
        touched = self.on_out[p] | self.on_in[q]
        if touched:
            self.rerate(touched, t)
        self.sending.discard((p, fl.direction))
        self.try_send(p, fl.direction, t)
        self.arrive(q, "F" if fl.direction == 1 else "B", fl.micro_batch, t)

    def rerate(self, flows: set[int], t: float) -> None:
        """Each flow's speed: 1 / the number of flows on the busier of its two ports (the engine's rate rule)."""
        for f in flows:
            fl = self.flows[f]
            fl.left -= fl.speed * (t - fl.since)
            fl.speed = 1.0 / max(len(self.on_out[fl.sender]), len(self.on_in[fl.sender + fl.direction]))
            fl.since = t
            fl.version += 1
            self.push(t + max(0.0, fl.left) / fl.speed, f, fl.version)


@dataclass
class _Flow:
    """One transfer in flight: `left` seconds of it at full speed, moving at `speed` since `since`; an end event
    counts only while it carries the current `version` (a rerate pushes a new one)."""

    sender: int
    direction: int
    micro_batch: int
    left: float
    speed: float = 1.0
    since: float = 0.0
    version: int = 0
