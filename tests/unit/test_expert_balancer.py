"""The expert balancer's loop without ranks (moebal/balance/experts.py): arms, gains, overlap rule, state."""

from __future__ import annotations

import numpy as np
import pytest

from moebal.balance.experts import ExpertBalancer
from moebal.config import from_dict
from moebal.planner.plan import ExpertPlacement

E, R = 4, 2
SKEWED_RE = 1000 * np.array([[60.0, 4.0, 2.0, 2.0], [58.0, 6.0, 2.0, 2.0]])  # expert 0 (rank 0's) is hot


def _balancer(policy: str = "prophet", overlap: bool = False, **feedback: object) -> ExpertBalancer:
    cfg = from_dict({"moe": {"num_experts": E, "top_k": 2},
                     "planner": {"policy": policy, "hysteresis": 0.0, "feedback": feedback}})
    b = ExpertBalancer(cfg, R, None, executor_overlaps=overlap)
    b.add_layer(0)
    b.add_layer(1)
    return b


def _step(b: ExpertBalancer, step: int, seconds: dict[str, float]) -> tuple[str, list[ExpertPlacement]]:
    """One step: apply the arm's placements, observe skewed counts, time the step by its arm."""
    used = b.begin_step([0, 1])
    arm = b.used_arm
    b.observe({0: SKEWED_RE, 1: SKEWED_RE}, step, seconds[arm] if b.feedback.cfg.enabled else None)
    return arm, used


def test_open_loop_applies_every_plan_and_takes_no_time():
    b = _balancer(enabled=False)
    assert b.step_time(lambda t: pytest.fail("no collective without feedback"), device="cpu") is None
    _step(b, 1, {})
    arm, used = _step(b, 2, {})
    assert arm == "plan" and all(p.num_replicas > 0 for p in used)  # skew: the hot expert is replicated
    assert b.predicted_gain > 0.0 and b.decisions() == []


def test_the_loop_starts_static_tries_the_plan_and_backs_off_when_it_measures_slower():
    b = _balancer(enabled=True, window=2, hold=3, max_hold=6)
    arms, replicas = [], []
    for step in range(1, 14):
        arm, used = _step(b, step, {"base": 1.0, "plan": 1.3})
        arms.append(arm)
        replicas.append(sum(p.num_replicas for p in used))
    # warm-up, a trial of 2 pairs (base plan plan base), 3 steps held on the base, a new trial, held again
    trial = ["base", "plan", "plan", "base"]
    assert arms == ["base", *trial, *["base"] * 3, *trial, "base"]
    assert all((r > 0) == (a == "plan") for a, r in zip(arms, replicas))  # base: static placement, no replica
    verdicts = b.decisions()
    assert [v["verdict"] for v in verdicts] == ["backed_off", "backed_off"]
    assert verdicts[0]["measured_gain"] == pytest.approx(-0.3) and verdicts[0]["predicted_gain"] > 0.0
    assert [v["hold"] for v in verdicts] == [3, 6]


def test_a_plan_that_pays_is_kept():
    b = _balancer(enabled=True, window=2)
    arms = [_step(b, step, {"base": 1.0, "plan": 0.8})[0] for step in range(1, 10)]
    assert arms == ["base", "base", "plan", "plan", "base"] + ["plan"] * 4
    assert [v["verdict"] for v in b.decisions()] == ["kept"]


@pytest.mark.parametrize("policy, planner_overlap, executor_overlaps, costed", [
    ("prophet", False, False, False), ("prophet", True, False, True), ("prophet", False, True, True),
    ("fastermoe", True, True, False)])
def test_plans_are_costed_with_overlap_when_the_executor_or_the_config_says_so(policy, planner_overlap,
                                                                               executor_overlaps, costed):
    cfg = from_dict({"moe": {"num_experts": E, "top_k": 2}, "planner": {"policy": policy, "overlap": planner_overlap}})
    b = ExpertBalancer(cfg, R, None, executor_overlaps=executor_overlaps)
    assert bool(b.add_layer(0).options.get("overlap", False)) is costed


def test_planner_max_replicas_reaches_every_layer_planner():
    # 4 experts on 2 ranks, expert 0 hot: uncapped, Pro-Prophet sends it to rank 1; with 0 it plans no replica
    for cap, replicas in ((None, 1), (0, 0)):
        cfg = from_dict({"moe": {"num_experts": E, "top_k": 2},
                         "planner": {"policy": "prophet", "hysteresis": 0.0, "max_replicas": cap}})
        b = ExpertBalancer(cfg, R, None, executor_overlaps=False)
        assert b.add_layer(0).options.get("max_replicas") == cap
        assert b.planners[0].step(SKEWED_RE).num_replicas == replicas


def test_planner_state_round_trips():
    a = _balancer(enabled=False)
    _step(a, 1, {})
    saved = {i: ExpertBalancer.planner_state(pl) for i, pl in a.planners.items()}
    b = _balancer(enabled=False)
    for i, s in saved.items():
        b.load_planner(i, s)
    assert [p.to_dict() for p in b.next_placements([0, 1])] == [p.to_dict() for p in a.next_placements([0, 1])]
    _step(a, 2, {})
    _step(b, 2, {})
    assert all(np.array_equal(a.planners[i].forecast_RE, b.planners[i].forecast_RE) for i in (0, 1))


def test_the_overlap_window_of_an_accumulating_step_is_one_forward_for_given_measured_and_loaded_costs():
    from moebal.planner.perf import MoELayerCosts

    costs = MoELayerCosts(token_bytes=256, expert_param_bytes=1e6, expert_grad_bytes=1e6, expert_tokens_per_s=1e5,
                          a2a_bandwidth=1e9, trans_bandwidth=1e9, agg_bandwidth=1e9, num_ranks=R)
    cfg = from_dict({"moe": {"num_experts": E, "top_k": 2}, "planner": {"policy": "prophet"}})
    b = ExpertBalancer(cfg, R, costs, executor_overlaps=True, overlap_share=0.25)
    b.add_layer(0)
    assert b.costs is not None and b.costs.overlap_share == 0.25 and b.planners[0].cost.overlap_share == 0.25
    b.set_costs(costs)  # measured (or loaded from a checkpoint) later: the same window
    assert b.costs.overlap_share == 0.25 and b.planners[0].cost.overlap_share == 0.25
    assert ExpertBalancer(cfg, R, costs, executor_overlaps=True).costs is costs  # one forward: as given


def test_a_pipeline_stage_s_collectives_fail_after_the_configured_timeout():
    """A stage's in-place scheduler takes `scheduler.timeout_s` (it had the scheduler's 120 s default whatever the
    config said); the gradient-sync mode stays `off` (a stage sums its gradients after its backward passes)."""
    import types

    import torch

    from moebal.balance.experts import _scheduler

    dims = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
    sched = _scheduler(dims, from_dict({"scheduler": {"timeout_s": 900.0, "mode": "lina"}}))
    try:
        assert sched.timeout_s == 900.0 and sched.mode == "off"
    finally:
        sched.close()
