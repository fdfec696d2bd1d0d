"""The balancers' closed loop (moebal/balance/feedback.py): arms, verdicts, holds, re-checks, resume."""

from __future__ import annotations

import pytest

from moebal.balance.feedback import FeedbackConfig, PlanFeedback
from moebal.errors import ConfigError


def run(fb: PlanFeedback, steps: int, base_s: float, plan_s: float, start: int = 1) -> list[bool]:
    """Feed `steps` steps whose time depends on the arm; return the arms used (True: plan)."""
    arms = []
    for step in range(start, start + steps):
        arms.append(fb.use_plan())
        fb.observe(step, plan_s if arms[-1] else base_s)
    return arms


def test_a_plan_that_pays_is_kept_and_rechecked():
    fb = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=4, recheck=20))
    arms = run(fb, 9, base_s=1.0, plan_s=0.8)
    assert arms == [False] * 5 + [True] * 4  # warm-up + 4 base steps, then a 4-step trial
    [event] = fb.drain()
    assert event == {"step": 9, "verdict": "kept", "base_s": 1.0, "plan_s": 0.8, "measured_gain": 0.2}
    arms = run(fb, 30, base_s=1.0, plan_s=0.8, start=10)
    assert arms[:20] == [True] * 20  # kept until the re-check at step 29
    assert arms[20:24] == [False] * 4 and arms[24:28] == [True] * 4  # fresh base window, then a trial
    assert [e["verdict"] for e in fb.drain()] == ["kept"]


def test_a_plan_that_measures_slower_backs_off_with_doubling_holds():
    fb = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=4, hold=10, max_hold=25, tolerance=0.03))
    arms = run(fb, 9, base_s=1.0, plan_s=1.3)
    [event] = fb.drain()
    assert event["verdict"] == "backed_off" and event["hold"] == 10 and event["measured_gain"] == -0.3
    arms = run(fb, 60, base_s=1.0, plan_s=1.3, start=10)
    assert arms[:10] == [False] * 10 and arms[10:14] == [True] * 4  # hold, then a new trial
    holds = [e["hold"] for e in fb.drain()]
    assert holds[:2] == [20, 25]  # doubled, capped at max_hold
    share = sum(run(fb, 1000, base_s=1.0, plan_s=1.3, start=70)) / 1000
    assert share < 0.2  # backed off most of the time: trials cost window / (window + max_hold) of the steps


def test_within_tolerance_is_kept_and_the_loop_follows_a_change_of_load():
    fb = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=3, recheck=10, tolerance=0.05))
    run(fb, 7, base_s=1.0, plan_s=1.04)
    assert fb.drain()[0]["verdict"] == "kept"
    run(fb, 40, base_s=1.0, plan_s=1.5, start=8)  # the plan stops paying: found at the next re-check
    verdicts = [e["verdict"] for e in fb.drain()]
    assert verdicts and verdicts[0] == "backed_off" and not fb.use_plan()


def test_disabled_always_plans_and_resume_continues_exactly():
    off = PlanFeedback(FeedbackConfig(enabled=False))
    assert all(run(off, 20, base_s=1.0, plan_s=2.0))
    a = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=3, hold=5))
    run(a, 11, base_s=1.0, plan_s=1.3)
    b = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=3, hold=5))
    b.load_state_dict(a.state_dict())
    assert run(a, 30, 1.0, 1.3, start=12) == run(b, 30, 1.0, 1.3, start=12)


@pytest.mark.parametrize("bad", [dict(tolerance=1.0), dict(window=0), dict(hold=8, max_hold=4), dict(recheck=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError, match="feedback"):
        FeedbackConfig(**bad)


def test_interleaved_trials_alternate_the_arms_in_pairs_and_keep_a_plan_that_pays():
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=4, recheck=20))
    arms = run(fb, 9, base_s=1.0, plan_s=0.8)
    assert arms == [False] + [False, True, True, False, False, True, True, False]  # warm-up, then 4 pairs
    [event] = fb.drain()
    assert event == {"step": 9, "verdict": "kept", "base_s": 1.0, "plan_s": 0.8, "measured_gain": 0.2}
    arms = run(fb, 30, base_s=1.0, plan_s=0.8, start=10)
    assert arms[:20] == [True] * 20 and arms[20:24] == [False, True, True, False]  # kept, then re-checked


def test_interleaved_trials_see_through_a_change_of_load_that_misleads_adjacent_windows():
    def loaded(fb: PlanFeedback, steps: int) -> list[bool]:
        """The plan is 10 % faster, but the machine's load doubles every step time from step 6 on."""
        arms = []
        for step in range(1, steps + 1):
            arms.append(fb.use_plan())
            fb.observe(step, (0.9 if arms[-1] else 1.0) * (2.0 if step >= 6 else 1.0))
        return arms

    paired = PlanFeedback(FeedbackConfig(enabled=True, window=4))
    loaded(paired, 9)
    assert [e["verdict"] for e in paired.drain()] == ["kept"] and paired.use_plan()
    windows = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=4))
    loaded(windows, 9)  # base steps 2-5 under the light load, plan steps 6-9 under the heavy one
    assert [e["verdict"] for e in windows.drain()] == ["backed_off"]


def test_an_interleaved_trial_of_a_slower_plan_backs_off_and_resumes_exactly():
    a = PlanFeedback(FeedbackConfig(enabled=True, window=2, hold=4))
    arms = run(a, 12, base_s=1.0, plan_s=1.3)
    # warm-up, a trial (b p p b), 4 held steps (the last one ends the hold), a new trial's first pair, ...
    assert arms == [False, False, True, True, False, False, False, False, False, False, True, True]
    assert [e["verdict"] for e in a.drain()] == ["backed_off"]
    b = PlanFeedback(FeedbackConfig(enabled=True, window=2, hold=4))
    b.load_state_dict(a.state_dict())
    assert run(a, 30, 1.0, 1.3, start=13) == run(b, 30, 1.0, 1.3, start=13)


def test_only_the_steps_a_verdict_reads_are_timed():
    """`wants_time`: an interleaved loop reads the times of its trials' steps only (the balancer spends no
    collective measuring the warm-up, a hold or a kept plan's stretch); rolling windows read every step. Giving
    no time where one is read is an error; giving none elsewhere changes nothing."""
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=2, hold=4, recheck=6))
    wanted, arms = [], []
    for step in range(1, 25):
        wanted.append(fb.wants_time())
        arms.append(fb.use_plan())
        fb.observe(step, (0.7 if arms[-1] else 1.0) if wanted[-1] else None)
    # warm-up, trial (4 steps, kept at step 5), the kept plan until its re-check at step 11, a trial, ...
    assert wanted[:12] == [False, True, True, True, True, False, False, False, False, False, False, True]
    assert [e["verdict"] for e in fb.drain()] == ["kept"] * 2
    # the same arms as a loop given every step's time
    assert arms == run(PlanFeedback(FeedbackConfig(enabled=True, window=2, hold=4, recheck=6)), 24, 1.0, 0.7)
    windows = PlanFeedback(FeedbackConfig(enabled=True, interleave=False, window=2))
    assert all(windows.wants_time() for _ in range(3))
    assert not PlanFeedback(FeedbackConfig(enabled=False)).wants_time()
    fb = PlanFeedback(FeedbackConfig(enabled=True, window=2))
    fb.observe(1, None)  # the warm-up: no time needed
    with pytest.raises(ValueError, match="needs its measured time"):
        fb.observe(2, None)
