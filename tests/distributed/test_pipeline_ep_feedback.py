"""The expert balancer's closed loop inside pipeline stages (2 stages x 2 expert shards on 4 gloo ranks): a
forced backing-off applies static placement on the base arm, the planner's replicas on the plan arm, and keeps
static placement's losses and parameters (at the expert-parallel tolerance: replicas sum expert gradients in
another order)."""

from __future__ import annotations

import dataclasses
import math

import torch

from moebal.config import FeedbackConfig
from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline_ep import _merge, _train, moe_cfg

STEPS = 8  # the second trial's plan arm (step 7) runs replicas; step 8's loss sees its update


def _worker(rank: int, world: int) -> dict:
    from moebal.balance.experts import ExpertBalancer

    static = _train(moe_cfg(), STEPS, micro_batches=2)
    open_loop = _train(moe_cfg(policy="broadcast_topk"), STEPS, micro_batches=2)
    # a machine on which the plan measures slower than static placement: every trial fails
    ExpertBalancer.step_time = lambda self, reduce_max, device: 2.0 if self.used_arm == "plan" else 1.0
    cfg = moe_cfg(policy="broadcast_topk")
    loop = FeedbackConfig(enabled=True, window=1, hold=2, max_hold=4)
    cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, feedback=loop))
    return {"static": static, "open": open_loop, "loop": _train(cfg, STEPS, micro_batches=2)}


def test_a_forced_backing_off_inside_stages_keeps_static_losses():
    ranks = run_ranks(_worker, 4)
    out = ranks[0]
    static, loop = out["static"], out["loop"]
    ref = _merge([r["static"]["state"] for r in ranks])
    for run in ("open", "loop"):  # replicated experts (Trans/Agg) change no number beyond the summation order
        want, got = static["losses"], out[run]["losses"]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(want, got)), (run, want, got)
        state = _merge([r[run]["state"] for r in ranks])
        assert set(state) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=f"{run}: {k}")
    records = loop["records"]
    # warm-up, a trial of one pair (base, plan), 2 steps held, a new trial, then a hold of 4
    assert [r["placement_next_arm"] for r in records] == ["base", "plan", "base", "base", "base", "plan", "base",
                                                          "base"]
    # the plan arm applies the planner's placements (those of the open loop), the base arm static placement
    planned = [r["replicas"] for r in out["open"]["records"]]
    assert sum(map(sum, planned)) > 0
    arms = ["base"] + [r["placement_next_arm"] for r in records[:-1]]
    assert [r["replicas"] for r in records] == [p if a == "plan" else [0] * len(p) for p, a in zip(planned, arms)]
    assert sum(map(sum, (r["replicas"] for r in records))) > 0  # the loop's plan arm really replicated experts
    verdicts = [v["verdict"] for r in records for v in r.get("placement_feedback", [])]
    assert verdicts == ["backed_off", "backed_off"]
