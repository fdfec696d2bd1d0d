"""The layer balancer's replay (`planner.schedule.simulate`) against the simulator's engine, transfers included."""

from __future__ import annotations

import numpy as np
import pytest

from moebal.planner.cost import CostModel
from moebal.planner.partition import partition_by_time, replay_time, should_adopt, stage_loads
from moebal.planner.schedule import make_schedule, simulate
from moebal.sim.engine import Engine
from moebal.sim.pipeline import _unit_profile, simulate_pipeline


def engine_time(name: str, fwd: list[float], bwd: list[float], M: int, p2p_s: float, w_share: float) -> float:
    """`simulate_pipeline`'s op graph on the engine, with zero bubble's W ops (which the simulator has not)."""
    P = len(fwd)
    cost = CostModel(_unit_profile(p2p_s), "fp32")
    topo = cost.topology(P)
    eng = Engine(topo)
    ops: dict[tuple[int, str, int], int] = {}
    for s in range(P):
        sched = make_schedule(name, P, s, M)
        split = w_share if any(kind == "W" for kind, _ in sched) else 0.0
        for kind, j in sched:
            dur = fwd[s] if kind == "F" else bwd[s] * (split if kind == "W" else 1.0 - split)
            ops[(s, kind, j)] = eng.compute(s, "compute", dur, f"{kind}{j}")
    for s in range(P - 1):
        for j in range(M):
            f = eng.collective(cost.p2p(topo, s, s + 1, 1.0), ["fwd_out", "fwd_in"], f"F{j} send",
                               deps=[[ops[(s, "F", j)]], []])
            eng.add_dep(ops[(s + 1, "F", j)], f[1])
            b = eng.collective(cost.p2p(topo, s + 1, s, 1.0), ["bwd_out", "bwd_in"], f"B{j} send",
                               deps=[[ops[(s + 1, "B", j)]], []])
            eng.add_dep(ops[(s, "B", j)], b[1])
    return eng.run().makespan


def test_replay_equals_the_simulator_for_any_transfer():
    # a transfer from 0 to 10 x a mean stage forward, random per-layer costs and partitions; the 1,152-case grid
    # of three draws per cell also gave at most 7e-13 s (1.4e-15 relative)
    rng = np.random.default_rng(0)
    worst = 0.0
    for name in ("gpipe", "1f1b"):
        for P in (2, 3, 4, 5):
            for M in (1, 2, 3, 4, 6, 8):
                L = P + int(rng.integers(0, 4))
                f_L = rng.uniform(0.5, 2.0, L)
                b_L = f_L * rng.uniform(1.5, 2.5, L)
                cuts = np.sort(rng.choice(np.arange(1, L), P - 1, replace=False))
                sizes = np.diff(np.concatenate([[0], cuts, [L]])).tolist()
                fwd, bwd = stage_loads(f_L.tolist(), sizes), stage_loads(b_L.tolist(), sizes)
                for k in (0.0, 0.05, 0.25, 0.5, 1.0, 2.25, 4.0, 10.0):
                    c = k * float(np.mean(fwd))
                    sim = simulate_pipeline(f_L, b_L, sizes, M, name, c).iteration_time_s
                    worst = max(worst, abs(simulate(name, fwd, bwd, M, c)[0] - sim) / sim)
    assert worst < 1e-12


@pytest.mark.parametrize("w_share", [0.0, 0.3, 0.5])
def test_zero_bubble_replay_equals_the_engine(w_share):
    # the simulator runs GPipe and 1F1B only; the same op graph with W ops is the reference for zero bubble
    rng = np.random.default_rng(1)
    for P, M in ((2, 4), (3, 6), (4, 8), (5, 5)):
        fwd = rng.uniform(0.5, 2.0, P).tolist()
        bwd = [x * float(rng.uniform(1.5, 2.5)) for x in fwd]
        for k in (0.0, 0.25, 1.0, 2.25, 5.0):
            c = k * float(np.mean(fwd))
            ref = engine_time("zb", fwd, bwd, M, c, w_share)
            assert simulate("zb", fwd, bwd, M, c, w_share)[0] == pytest.approx(ref, rel=1e-12, abs=1e-12)
    # the reference is the simulator's own graph: for 1F1B it gives simulate_pipeline's time
    assert engine_time("1f1b", [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], 6, 2.5, 0.5) == pytest.approx(
        simulate_pipeline([1.0, 2.0, 1.5], [2.0, 4.0, 3.0], [1, 1, 1], 6, "1f1b", 2.5).iteration_time_s)


def test_a_large_transfer_queues_and_turns_the_balancer_s_verdict():
    # 6 layers of forward [2, 1, 1, 2, 1, 1] (backward 2x), 3 stages, 6 micro-batches, a transfer of 2.25 (a
    # unit layer's forward x 2.25). The min-max partition [2, 2, 2] evens the stages (forward 3, 3, 2 against 2,
    # 4, 2). With transfers as pure delays the replay put it at 88.5 against the current 91.5 (a 3.3 % gain, which
    # the balancer adopted); the simulator, and now the replay, at 93.0: a transfer of one boundary and direction
    # waits for the one before it, and transfers through one stage's port share it
    f_L = [2.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    b_L = [2 * x for x in f_L]
    costs = [f + b for f, b in zip(f_L, b_L)]
    assert partition_by_time(costs, 3) == [2, 2, 2]

    def t_iter(sizes):
        return replay_time(stage_loads(f_L, sizes), stage_loads(b_L, sizes), 6, 2.25)

    for sizes, want in (([1, 3, 2], 91.5), ([2, 2, 2], 93.0)):
        assert t_iter(sizes) == pytest.approx(want, abs=1e-12)
        assert simulate_pipeline(f_L, b_L, sizes, 6, "1f1b", 2.25).iteration_time_s == pytest.approx(want,
                                                                                                     abs=1e-12)
    adopt, gain, cost = should_adopt(costs, [1, 3, 2], [2, 2, 2], 6, 10, [0.0] * 6, 1e9, time_fn=t_iter)
    assert not adopt and gain == pytest.approx(-15.0) and cost == 0.0


def test_a_transfer_shorter_than_every_op_can_still_share_a_port():
    # forward 2.3, 1.6, 1.9 (backward 2x), 4 micro-batches, 1F1B, a transfer of 0.5: no transfer ever waits for
    # the one before it on its stream, but stage 0's forward 3 (sent at 21.7) and stage 2's gradient 2 (sent at
    # 22.1) both enter stage 1: from 22.1 each moves at half speed, so the activation lands at 22.3, not 22.2,
    # and stage 1's ops after it, and stage 0's last backward, end 0.1 later (38.9; as pure delays 38.8)
    fwd, bwd = [2.3, 1.6, 1.9], [4.6, 3.2, 3.8]
    makespan, ops = simulate("1f1b", fwd, bwd, 4, 0.5)
    start = {(o.stage, o.kind, o.micro_batch): o.start for o in ops}
    assert start[(1, "F", 3)] == pytest.approx(22.3) and makespan == pytest.approx(38.9)
    assert makespan == pytest.approx(simulate_pipeline(fwd, bwd, [1, 1, 1], 4, "1f1b", 0.5).iteration_time_s, abs=1e-12)
    # two stages share no port and no transfer queues behind one as long as a forward: pure delays
    assert simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 4, 1.0)[0] == 19.0
