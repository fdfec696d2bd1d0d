"""A loss spike (`InjectedSpike`: every weight x30) under expert parallelism (Pro-Prophet's replicas), in a 2-stage
pipeline, with FSDP2's sharded state and expert weights sharded at rest, on pipeline stages of expert shards and on
planned micro-batches (their background planner keeps running): the job rolls back to its newest checkpoint in the
same processes and process groups (`train_with_rollbacks`, what `moebal train` runs), skips the batches since it,
and trains on bit for bit as the checkpoint resumed past those batches would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import shard_cfg

SPIKE = {"spike": {"action": "rollback", "factor": 3.0, "window": 3, "skip_extra": 1}, "ckpt_every": 3,
         "keep_checkpoints": 5}
# name: (ranks, parallel.shard, parallel, planner.policy, more sections)
LAYOUTS: dict[str, tuple[int, str, dict[str, Any], str, dict[str, dict[str, Any]]]] = {
    "ep 2, prophet": (2, "none", {"ep": 2}, "prophet", {}),
    "pp 2": (2, "none", {"pp": 2, "ep": 1}, "static", {}),
    "full, dp 2": (2, "full", {"ep": 1}, "static", {}),
    "pp 2 x ep 2, prophet": (4, "none", {"pp": 2, "ep": 2}, "prophet", {}),
    # ep 2 x dp 2: the expert weights sharded at rest, freed between steps (the spike gathers them to write them)
    "full, ep 2 x dp 2": (4, "full", {"ep": 2}, "static", {}),
    # a fixed micro-batch cost table: the rolled-back run and the reference each start a planner of their own
    "pp 2, planned micro-batches": (2, "none", {"pp": 2, "ep": 1}, "static",
                                    {"pipeline": {"microbatching": "dynamic", "dynamic": {"costs": "a100"}}}),
}


def _rolled_back(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    from moebal.commands.train import build_trainer
    from moebal.train.spikes import InjectedSpike, read_rollbacks, train_with_rollbacks

    _, shard, parallel, policy, sections = LAYOUTS[layout]
    cfg = shard_cfg(shard, parallel["ep"], policy, 8, parallel=parallel, sections=sections, **SPIKE)
    run, ref = Path(root) / "run", Path(root) / "ref"
    first = build_trainer(cfg, run, False, False)
    first.hooks.append(InjectedSpike(5))  # what MOEBAL_INJECT_SPIKE=5 adds to `moebal train`'s trainers
    dims = first.ctx.dims
    rebuilt: list[Any] = []

    def rebuild(ckpt: Path, d: Any) -> Any:
        assert d is dims  # the same process groups
        rebuilt.append(build_trainer(cfg, run, str(ckpt), False, d))
        return rebuilt[-1]

    result = train_with_rollbacks(first, rebuild, lambda t: t.train())
    assert result.rollbacks == 1 and len(rebuilt) == 1
    # the reference: the checkpoint resumed in another directory, steps 4 and 5's batches and one more dropped
    other = build_trainer(cfg, ref, str(run / "ckpt-0000003"), False, dims)
    for _ in range(3):
        other.data.train.next_samples()
    train_with_rollbacks(other, rebuild, lambda t: t.train())
    if not first.ctx.is_main:
        return {}

    def losses(d: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {"run": losses(run), "ref": losses(ref), "rollbacks": read_rollbacks(run),
            "replicas": [sum(r.get("replicas", [0])) for r in rows]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rollback_trains_on_as_the_checkpoint_resumed_past_the_skipped_batches(tmp_path, layout):
    out = run_ranks(_rolled_back, LAYOUTS[layout][0], str(tmp_path), layout, timeout_s=300)[0]
    (rec,) = out["rollbacks"]
    assert rec["step"] == 5 and rec["resume_step"] == 3 and rec["skipped_batches"] == 3
    assert sorted(out["run"]) == list(range(1, 9))
    assert all(out["run"][s] == out["ref"][s] for s in range(4, 9)), (out["run"], out["ref"])
    if "prophet" in layout:
        assert sum(out["replicas"]) > 0  # Pro-Prophet replicated experts across the rollback


def _async_target(rank: int, world: int, root: str) -> dict[str, Any]:
    import time

    from moebal.commands.train import build_trainer
    from moebal.train.checkpoint import Checkpointer
    from moebal.train.spikes import InjectedSpike, read_rollbacks, train_with_rollbacks

    complete = Checkpointer._complete

    def late(self: Any, tmp: Path, snap: Any) -> None:  # rank 0 publishes the step-4 save late
        time.sleep(1.0 if snap.step == 4 else 0.0)
        complete(self, tmp, snap)

    Checkpointer._complete = late  # type: ignore[method-assign]
    cfg = shard_cfg("none", 1, "static", 6, parallel={"pp": 2, "ep": 1},
                    **{**SPIKE, "ckpt_every": 2, "ckpt_async": True})
    first = build_trainer(cfg, Path(root) / "run", False, False)
    first.hooks.append(InjectedSpike(5))
    train_with_rollbacks(first, lambda ckpt, d: build_trainer(cfg, Path(root) / "run", str(ckpt), False, d),
                         lambda t: t.train())
    return {"rollbacks": read_rollbacks(Path(root) / "run")}


def test_a_rollback_goes_back_to_the_save_of_the_step_before_however_late_its_publication(tmp_path):
    """`train.ckpt_async`: the step-4 save is still being published by rank 0 when step 5 spikes. Every rank waits
    for it before any lists the checkpoints, so the run goes back to step 4 (a rank that listed before rank 0's
    rename went back to step 2, so the run after a rollback depended on timing)."""
    (rec,) = run_ranks(_async_target, 2, str(tmp_path), timeout_s=300)[0]["rollbacks"]
    assert (rec["step"], rec["resume_step"], rec["skipped_batches"]) == (5, 4, 2)

