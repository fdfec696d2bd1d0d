"""Communication plan of a pipeline iteration: every stage's instruction stream, in one global order, and a
checker that proves the plan cannot deadlock.

Shape legend: P = stages. A transfer is `act j` (stage p -> p + 1, after F(j) on p) or `grad j`
(stage p -> p - 1, after B(j) on p).

Instructions (DynaPipe §2, each transfer split into a Start and a Wait):
    F j, B j                      compute
    send_act j / send_grad j      post the send of the tensor just produced (non-blocking)
    recv_act j / recv_grad j      post the receive into a buffer of the planned shape (non-blocking)
    wait_act j / wait_grad j      wait for that receive (placed right before the op that consumes it)
    wait_send_act j               wait for the activation send (right before B(j): the buffer is freed then)
    wait_send_grad j              wait for the gradient send (at the end of the iteration)

Rule (DynaPipe §7): sort every compute op of the simulated timeline by its end time; the transfers it
produces, taken in that order, form one global order; every stage posts its sends and receives as a
subsequence of it (a send and its receive at the producer's end time), merged with its compute ops by
simulated time. Why that cannot deadlock, whatever the real op durations (seed §7.3): the global order
extends the dependency DAG (an op ends after its inputs were produced and after the previous op of its
stage), so by induction the earliest unfinished transfer has its producer runnable and sits at the head of
both endpoints' queues. The cost model only decides how much communication overlaps compute.

`check_plan` is the logical rendezvous model of the strictest backend (NCCL: one FIFO of communication per
device, an operation completes only together with its match at the head of the peer's FIFO): it executes
the streams and reports a deadlock, or a plan that breaks a data dependency. gloo matches point-to-point
messages by (peer, tag) and buffers small sends, so a CPU run can hide an ordering bug that would hang NCCL;
this checker is what proves the order (seed §7.5).

`naive_plan` is the unordered scheme the paper warns about: send right after the producing op and wait for
it, receive right before the consuming op. It deadlocks on 1F1B and adaptive orders of 2+ stages and 2+
micro-batches (tested); GPipe's order, all forwards before any backward, happens to complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CheckResult", "build_comm_plan", "check_plan", "naive_plan"]

Instr = tuple[str, int]
COMPUTE = ("F", "B")


def _produces(kind: str, p: int, P: int) -> str | None:
    if kind == "F" and p < P - 1:
        return "act"
    if kind == "B" and p > 0:
        return "grad"
    return None


def build_comm_plan(ops: Sequence[tuple[int, str, int, float, float]], num_stages: int) -> list[list[Instr]]:
    """Per-stage instruction streams from a simulated timeline `(stage, kind, mb, start, end)`."""
    P = num_stages
    by_end = sorted(ops, key=lambda o: (o[4], o[0], o[1], o[2]))
    # (time, 0 = comm before compute at equal times, global index, instruction) per stage
    keyed: list[list[tuple[float, int, int, Instr]]] = [[] for _ in range(P)]
    for g, (p, kind, j, _start, end) in enumerate(by_end):
        what = _produces(kind, p, P)
        if what is None:
            continue
        dst = p + 1 if what == "act" else p - 1
        keyed[p].append((end, 0, g, (f"send_{what}", j)))
        keyed[dst].append((end, 0, g, (f"recv_{what}", j)))
    for g, (p, kind, j, start, _end) in enumerate(sorted(ops, key=lambda o: (o[3], o[0]))):
        keyed[p].append((start, 1, g, (kind, j)))
    streams: list[list[Instr]] = []
    for p in range(P):
        out: list[Instr] = []
        for _t, _c, _g, (op, j) in sorted(keyed[p], key=lambda x: (x[0], x[1], x[2])):
            if op == "F" and p > 0:
                out.append(("wait_act", j))
            if op == "B" and p < P - 1:
                out += [("wait_grad", j), ("wait_send_act", j)]
            out.append((op, j))
        out += [("wait_send_grad", j) for op, j in list(out) if op == "send_grad"]
        streams.append(out)
    return streams


def naive_plan(orders: Sequence[Sequence[tuple[str, int]]]) -> list[list[Instr]]:
    """Unfused blocking transfers: receive just before use, send just after production, each waited at once."""
    P = len(orders)
    streams = []
    for p, order in enumerate(orders):
        out: list[Instr] = []
        for kind, j in order:
            if kind == "F" and p > 0:
                out += [("recv_act", j), ("wait_act", j)]
            if kind == "B" and p < P - 1:
                out += [("recv_grad", j), ("wait_grad", j)]
            out.append((kind, j))
            what = _produces(kind, p, P)
            if what is not None:
                out += [(f"send_{what}", j), (f"wait_send_{what}", j)]
        streams.append(out)
    return streams


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _validate(streams: Sequence[Sequence[Instr]]) -> str:
    """'' when every stage computes each micro-batch once, forward before backward, and every transfer is
    posted after its producer, received before its consumer and waited for; else what is wrong."""
    P = len(streams)
    posted = [{tuple(x) for x in stream} for stream in streams]  # once per stage, not per micro-batch and peer
    for p, stream in enumerate(streams):
        seen: set[Instr] = set()
        fwd = {j for op, j in stream if op == "F"}
        if fwd != {j for op, j in stream if op == "B"}:
            return f"stage {p}: forwards {sorted(fwd)} and backwards differ"
        for op, j in stream:
            if (op, j) in seen and op in COMPUTE:
                return f"stage {p}: {op} {j} twice"
            need: list[Instr] = []
            if op == "B":
                need.append(("F", j))
            if op == "F" and p > 0:
                need.append(("wait_act", j))
            if op == "B" and p < P - 1:
                need.append(("wait_grad", j))
            if op.startswith("wait_send_"):
                need.append((f"send_{op[len('wait_send_'):]}", j))
            elif op.startswith("wait_"):
                need.append((f"recv_{op[len('wait_'):]}", j))
            if op.startswith("send_"):
                need.append(("F" if op == "send_act" else "B", j))
            missing = [n for n in need if n not in seen]
            if missing:
                return f"stage {p}: {op} {j} comes before {missing[0][0]} {missing[0][1]}"
            seen.add((op, j))
        for op, j in stream:
            if op.startswith(("send_", "recv_")):
                base = op.split("_", 1)[1]
                waiter = f"wait_send_{base}" if op.startswith("send_") else f"wait_{base}"
                if (waiter, j) not in seen:
                    return f"stage {p}: {op} {j} is never waited for"
        for j in fwd:
            for what, peer in (("act", p + 1), ("grad", p - 1)):
                sent = (f"send_{what}", j) in seen
                if 0 <= peer < P and sent != ((f"recv_{what}", j) in posted[peer]):
                    return f"stage {p}: {what} {j} is sent to stage {peer} without a matching receive"
    return ""


def check_plan(streams: Sequence[Sequence[Instr]]) -> CheckResult:
    """Execute the streams under rendezvous semantics (one FIFO per stage); ok, or why not."""
    bad = _validate(streams)
    if bad:
        return CheckResult(False, f"invalid plan: {bad}")
    P = len(streams)
    ptr = [0] * P
    fifo: list[deque[tuple[str, str, int]]] = [deque() for _ in range(P)]  # (direction, what, mb)
    finished: set[tuple[int, str, str, int]] = set()  # (stage, direction, what, mb)

    def peer(p: int, direction: str, what: str) -> int:
        forward = what == "act"
        return (p + 1 if forward else p - 1) if direction == "send" else (p - 1 if forward else p + 1)

    while True:
        progressed = False
        for p in range(P):
            while ptr[p] < len(streams[p]):
                op, j = streams[p][ptr[p]]
                if op.startswith(("send_", "recv_")):
                    direction, what = op.split("_", 1)
                    fifo[p].append((direction, what, j))
                elif op.startswith("wait_"):
                    rest = op[len("wait_"):]
                    key = (p, "send", rest[len("send_"):], j) if rest.startswith("send_") else (p, "recv", rest, j)
                    if key not in finished:
                        break
                ptr[p] += 1
                progressed = True
        for p in range(P):
            if not fifo[p]:
                continue
            direction, what, j = fifo[p][0]
            q = peer(p, direction, what)
            other = "recv" if direction == "send" else "send"
            if fifo[q] and fifo[q][0] == (other, what, j):
                fifo[p].popleft()
                fifo[q].popleft()
                finished.add((p, direction, what, j))
                finished.add((q, other, what, j))
                progressed = True
        if not progressed:
            break
    if all(ptr[p] == len(streams[p]) for p in range(P)) and not any(fifo):
        return CheckResult(True)
    stuck = []
    for p in range(P):
        head = f"{fifo[p][0][0]} {fifo[p][0][1]} {fifo[p][0][2]}" if fifo[p] else "empty"
        at = streams[p][ptr[p]] if ptr[p] < len(streams[p]) else ("end", -1)
        stuck.append(f"stage {p} at {at[0]} {at[1]} (comm queue head: {head})")
    return CheckResult(False, "deadlock: " + "; ".join(stuck))
