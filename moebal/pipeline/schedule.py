"""Pipeline schedules as data: the ordered forward/backward operations of one stage, and a replay.

Shape legend: P = stages, M = micro-batches.

A schedule is a list of `(kind, micro_batch)` with kind "F" (forward) or "B" (backward). Both schedules below
are deadlock-free under the engine's communication rule (every send is non-blocking, every receive blocks):
a stage's receive for F(j) waits only on F(j) upstream, its receive for B(j) only on B(j) downstream, and
B(j) on the last stage follows F(j) on that same stage, so the wait graph is acyclic.

`simulate` replays per-stage schedules on given per-micro-batch times (the same rule, no communication
cost unless given) and is what the planner's predicted iteration time and the Gantt charts of a plan use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moebal.errors import ConfigError

__all__ = ["SCHEDULES", "Op", "TimedOp", "gpipe", "make_schedule", "one_f_one_b", "simulate"]

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


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[Op]:
    """1F1B (PipeDream-flush): P - p - 1 warm-up forwards, then alternate one forward and one backward,
    then drain; at most P - p micro-batches' activations are alive on stage p."""
    _check(num_stages, stage, num_micro)
    warm = min(num_stages - stage - 1, num_micro)
    ops: list[Op] = [("F", j) for j in range(warm)]
    for j in range(num_micro - warm):
        ops += [("F", warm + j), ("B", j)]
    ops += [("B", j) for j in range(num_micro - warm, num_micro)]
    return ops


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, stage: int, num_micro: int) -> list[Op]:
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, stage, num_micro)


def in_flight(name: str, num_stages: int, stage: int, num_micro: int) -> int:
    """Most micro-batches whose activations a stage holds at once (for the memory model)."""
    alive = peak = 0
    for kind, _ in make_schedule(name, num_stages, stage, num_micro):
        alive += 1 if kind == "F" else -1
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


def simulate(name: str, fwd: Times, bwd: Times, num_micro: int, comm_s: float = 0.0) -> tuple[float, list[TimedOp]]:
    """(makespan, ops) of one iteration; `fwd[p]`/`bwd[p]` are stage p's per-micro-batch times (a number, or
    one per micro-batch). A backward time of 0 means the stage has nothing to differentiate (frozen)."""
    P = len(fwd)
    if len(bwd) != P:
        raise ConfigError(f"fwd has {P} stages but bwd has {len(bwd)}")

    def at(x: Sequence[float] | float, j: int) -> float:
        return float(x) if isinstance(x, (int, float)) else float(x[j])

    scheds = [make_schedule(name, P, p, num_micro) for p in range(P)]
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    out: list[TimedOp] = []
    while any(pos[p] < len(scheds[p]) for p in range(P)):
        progressed = False
        for p in range(P):
            if pos[p] >= len(scheds[p]):
                continue
            kind, j = scheds[p][pos[p]]
            dep = ("F", p - 1, j) if kind == "F" else ("B", p + 1, j)
            if (kind == "F" and p == 0) or (kind == "B" and p == P - 1):
                ready = done[("F", p, j)] if kind == "B" else 0.0
            elif dep in done:
                ready = done[dep] + comm_s
            else:
                continue
            start = max(free[p], ready)
            end = start + (at(fwd[p], j) if kind == "F" else at(bwd[p], j))
            done[(kind, p, j)] = free[p] = end
            out.append(TimedOp(p, kind, j, start, end))
            pos[p] += 1
            progressed = True
        assert progressed, "schedule deadlocked"  # programmer invariant: both schedules are acyclic
    return max(free), out
