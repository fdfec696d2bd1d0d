"""Pro-Prophet's block overlap inside pipeline stages (`scheduler.block_overlap` with parallel.pp > 1), on 2 stages x
2 expert shards (4 gloo ranks): Trans of each next MoE layer issued as a layer starts its first micro-batch, Agg
inside the stage's last backward with the earlier passes' sum. Losses and final weights are the same bit for bit
as the same run without the overlap, under every schedule, with dynamism skipping a stage's layers, with a layer
migration, and with planned (variable) micro-batches; replicas were placed and Agg went out in the backward."""

from __future__ import annotations

import dataclasses

import pytest

from moebal.config import Config
from moebal.distributed.testing import run_ranks
from tests.distributed.test_microbatching import SAMPLES, docs, write_samples
from tests.distributed.test_pipeline_ep import _train, moe_cfg

CASES: dict[str, dict] = {
    # name: _train's options (the schedule and micro-batches are `pipeline.*` fields)
    "1f1b, 2 micro-batches": {"micro_batches": 2},
    "gpipe, 4 micro-batches": {"micro_batches": 4, "schedule": "gpipe"},
    "zb, 4 micro-batches": {"micro_batches": 4, "schedule": "zb"},
    # nobody exits before step 3; from then on nearly every token leaves after layer 1, so the later MoE layers
    # run on no token and their Agg goes out after the backward (`ExpertParallel.aggregate`)
    "early exit, migration": {"micro_batches": 2, "scheme": "early_exit", "force": ((2, (4, 2)),),
                              "options": {"threshold": 0.9, "first_layer": 1, "start": 3}},
}


def _overlap(cfg: Config, on: bool) -> Config:
    """The executor overlaps (`on`) or not; the planner costs eq. 8 either way (`planner.overlap` when the executor
    does not), so both runs make the same placements and only when Trans and Agg go out differs."""
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, block_overlap=on),
                               planner=dataclasses.replace(cfg.planner, overlap=not on))


def _agg_in_backward() -> dict[str, int]:
    """Count the Agg issues made inside the backward pass and after it (in `ExpertParallel.aggregate`)."""
    from moebal.distributed.expert_parallel import ExpertParallel

    counts = {"in_backward": 0, "after": 0}
    issue, aggregate = ExpertParallel._agg_issue, ExpertParallel.aggregate
    inside = [False]

    def counted(self, i, grads, earlier=False):
        counts["after" if inside[0] else "in_backward"] += 1
        return issue(self, i, grads, earlier)

    def aggregating(self):
        inside[0] = True
        try:
            return aggregate(self)
        finally:
            inside[0] = False

    ExpertParallel._agg_issue, ExpertParallel.aggregate = counted, aggregating  # type: ignore[method-assign]
    return counts


def _four_ranks(rank: int, world: int, samples: str) -> dict:
    counts = _agg_in_backward()
    out: dict[str, dict] = {}
    for name, opts in CASES.items():
        opts = dict(opts)
        scheme, options = opts.pop("scheme", "none"), opts.pop("options", None)
        cfg = moe_cfg(n_layers=6 if scheme != "none" else 4, policy="prophet")
        for on in (False, True):
            before = dict(counts)
            run = _train(_overlap(cfg, on), 5, scheme, options, **opts)
            run["agg"] = {k: counts[k] - before[k] for k in counts}
            out[f"{name}, {'on' if on else 'off'}"] = run
    SAMPLES["path"] = samples
    planned = docs(nproc=4, moe=4, ep=2, max_tokens=96)
    planned = dataclasses.replace(planned, planner=dataclasses.replace(planned.planner, hysteresis=0.0))
    from tests.distributed.test_microbatching import _train as planned_train

    for on in (False, True):
        before = dict(counts)
        run = planned_train(_overlap(planned, on), 3)
        run["agg"] = {k: counts[k] - before[k] for k in counts}
        out[f"planned micro-batches, {'on' if on else 'off'}"] = run
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    samples = write_samples(str(tmp_path_factory.mktemp("samples") / "samples.jsonl"))
    return run_ranks(_four_ranks, 4, samples, timeout_s=600)


@pytest.mark.parametrize("case", [*CASES, "planned micro-batches"])
def test_block_overlap_in_pipeline_stages_keeps_the_losses_and_weights_bit_for_bit(four, case):
    for r in four:
        off, on = r[f"{case}, off"], r[f"{case}, on"]
        assert on["losses"] == off["losses"], (case, on["losses"], off["losses"])
        if "state" in off:
            assert off["state"].keys() == on["state"].keys()
            assert all((off["state"][k] == on["state"][k]).all() for k in off["state"]), case
        assert off["agg"]["in_backward"] == 0 and off["agg"]["after"] > 0  # without: every Agg after the backward
        assert on["agg"]["in_backward"] > 0, (case, on["agg"])  # with: Agg went out inside the last backward
        if "early exit" in case:  # ... except for the layers the last micro-batch did not reach
            assert on["agg"]["after"] > 0, on["agg"]
    if "records" in four[0][f"{case}, on"]:
        assert sum(sum(x["replicas"]) for x in four[0][f"{case}, on"]["records"]) > 0  # replicas were placed
