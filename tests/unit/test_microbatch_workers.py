"""The planning workers of `PlanAhead` do not outlive the rank that started them."""

import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from test_microbatch import quad_table
from moebal.balance.microbatch_workers import PlanAhead

ahead = PlanAhead(quad_table(), {}, workers=1)
ahead.submit(1, [100, 60, 40, 200])
plan, _ = ahead.get(1)
assert plan.micro_batches, "the worker planned nothing"
print(*ahead._pool._processes, flush=True)
os._exit(0)  # dies as a killed rank does: no pool shutdown, no sentinel to the idle worker
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited; its new parent has not reaped it yet


def test_an_idle_worker_exits_when_its_rank_dies_without_shutting_the_pool_down(tmp_path: Path) -> None:
    here = str(Path(__file__).parent)
    log = tmp_path / "out.txt"
    with log.open("w") as f:  # a file, not a pipe: an orphaned worker holding a pipe would block run() itself
        rc = subprocess.run([sys.executable, "-c", CHILD, here], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    assert rc == 0, log.read_text()
    pids = [int(p) for p in log.read_text().split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 20
    while not _gone(pids[0]):
        assert time.monotonic() < deadline, f"planning worker {pids[0]} outlived its rank by 20 s"
        time.sleep(0.1)


def test_a_new_table_keeps_the_workers_and_close_leaves_no_pool_winding_down() -> None:
    # a pool still shutting down when the process exits can make CPython 3.11's exit hook write to a pipe its
    # manager thread is closing (EBADF: a rank that trained to the end exited 1)
    import threading
    from concurrent.futures import process

    from moebal.balance.microbatch_workers import PlanAhead
    from tests.unit.test_microbatch import quad_table

    ahead = PlanAhead(quad_table(), {}, workers=1)
    ahead.submit(1, [100, 60, 40, 200])
    ahead.get(1)
    workers = set(ahead._pool._processes)
    ahead.set_cost(quad_table(P=2))  # the same workers plan on the new table: no pool is started anew
    ahead.submit(2, [100, 60, 40, 200])
    assert ahead.get(2)[0].stages == 2 and set(ahead._pool._processes) == workers
    ahead.close()
    managers = [t for t in threading.enumerate() if isinstance(t, process._ExecutorManagerThread)]
    assert managers == []


def test_a_replan_plans_the_submitted_steps_again_on_the_new_table_and_drops_the_old_generation():
    """After a re-pack (4 stages -> 2) the steps already submitted are planned again for 2 stages; the old
    generation's plans, finished or not, are never returned (inline planning and one background worker)."""
    from moebal.balance.microbatch_workers import PlanAhead
    from tests.unit.test_microbatch import quad_table

    for workers in (0, 1):
        store = _Store()
        ahead = PlanAhead(quad_table(P=4), {}, workers=workers, store=store)
        try:
            for step in (1, 2, 3):
                ahead.submit(step, [100, 60, 40, 200])
            assert ahead.get(1)[0].stages == 4
            ahead.replan(quad_table(P=2), [(2, [100, 60, 40, 200]), (3, [30, 30])])
            assert ahead.generation == 1
            two, three = ahead.get(2)[0], ahead.get(3)[0]
            assert (two.stages, three.stages) == (2, 2)
            assert sorted(len(r) for mb in three.micro_batches for r in mb.rows) == [1, 1]  # the new lengths
            assert all(len(r.streams) == 2 for r in two.replicas)
            # the store holds the new generation's plans only: the old one's, made before the replan or finishing
            # after it, are deleted or never stored (a long job migrates, and replans, often)
            time.sleep(0.5)  # a worker's plan of the old generation may still be on its way to the publisher
            assert {k.split("/")[1] for k in store.keys} == {"1"}, store.keys
            ahead.submit(4, [10, 20])
            ahead.submit(5, [10, 20])
            ahead.get(4)
            ahead.get(5)  # step s deletes step s - 2's: every rank has read it
            assert sorted(store.keys) == ["mbplan/1/4", "mbplan/1/5"], store.keys
        finally:
            ahead.close()


class _Store:
    """The part of a TCPStore `PlanAhead` uses."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def delete_key(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None


def test_a_plan_is_costed_on_the_table_scaled_by_the_schemes_stage_factors():
    """`submit(..., scale)` plans on `cost.scaled(scale)`, inline and in a worker: the same plan as planning on the
    scaled table directly; the bottleneck stage's scale sets the plan's predicted time."""
    from moebal.balance.microbatch_workers import PlanAhead
    from moebal.planner.microbatch import plan_microbatches
    from tests.unit.test_microbatch import quad_table

    lengths, scale = [100, 60, 40, 200, 30, 30, 120], [1.0, 2.5, 1.0, 0.5]
    want = plan_microbatches(lengths, quad_table().scaled(scale))
    plain = plan_microbatches(lengths, quad_table())
    assert want.predicted_time_s > plain.predicted_time_s  # stage 1 now 2.5x: the pipeline's pace
    for workers in (0, 1):
        ahead = PlanAhead(quad_table(), {}, workers=workers)
        try:
            ahead.submit(1, lengths, scale)
            ahead.submit(2, lengths)
            got, unscaled = ahead.get(1)[0], ahead.get(2)[0]
        finally:
            ahead.close()
        assert got.micro_batches == want.micro_batches and got.predicted_time_s == want.predicted_time_s
        assert unscaled.predicted_time_s == plain.predicted_time_s
