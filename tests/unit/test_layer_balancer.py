"""The layer balancer's closed loop in its plan-point mode (`PlanFeedback(auto=False)`, balance/layers.py)."""

from __future__ import annotations

from moebal.balance.feedback import FeedbackConfig, PlanFeedback


def steps(fb: PlanFeedback, first: int, last: int, seconds: float) -> None:
    for s in range(first, last + 1):
        fb.observe(s, seconds)


def test_trials_start_only_when_the_balancer_adopts_a_plan():
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=3), auto=False)
    assert not fb.can_try(1)  # nothing measured yet: no base to compare with
    steps(fb, 1, 10, 1.0)  # step 1 is warm-up; the base window rolls and never starts a trial by itself
    assert fb.arm == "base" and fb.times["base"] == [1.0, 1.0, 1.0] and fb.can_try(10)
    fb.begin_trial(10)
    steps(fb, 11, 12, 0.8)
    assert fb.arm == "plan" and not fb.can_try(12)  # a trial in progress
    fb.observe(13, 0.8)
    [event] = fb.drain()
    assert event["verdict"] == "kept" and event["measured_gain"] == 0.2
    # the kept plan is the base of the next trial: no re-check, no switch back
    assert fb.arm == "base" and fb.times["base"] == [0.8, 0.8, 0.8] and fb.can_try(13)


def test_a_slower_plan_is_backed_off_and_held_with_doubling_holds():
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=2, hold=4, max_hold=6), auto=False)
    steps(fb, 1, 3, 1.0)
    fb.begin_trial(3)
    steps(fb, 4, 5, 1.5)
    [event] = fb.drain()
    assert event["verdict"] == "backed_off" and event["hold"] == 4 and event["plan_s"] == 1.5
    assert fb.arm == "base" and not fb.can_try(6)
    steps(fb, 6, 9, 1.0)
    assert fb.can_try(9)  # the hold ended at step 9 with base steps measured
    fb.begin_trial(9)
    steps(fb, 10, 11, 1.5)
    assert fb.drain()[0]["hold"] == 6  # 8, capped at max_hold


def test_cancel_drops_the_trial_and_the_base_and_resume_continues():
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=2), auto=False)
    steps(fb, 1, 3, 1.0)
    fb.begin_trial(3)
    fb.observe(4, 2.0)
    fb.cancel()  # a forced migration replaced both partitions
    assert fb.arm == "base" and not fb.can_try(4)
    fb.observe(5, 1.0)
    other = PlanFeedback(FeedbackConfig(enabled=True, window=2), auto=False)
    other.load_state_dict(fb.state_dict())
    assert other.can_try(5) and other.times == fb.times
    assert not fb.drain()


def test_disabled_never_holds_a_plan_back():
    fb = PlanFeedback(FeedbackConfig(enabled=False), auto=False)
    assert fb.can_try(1)
    fb.begin_trial(1)
    steps(fb, 2, 20, 5.0)
    assert fb.use_plan() and not fb.drain()
