"""Closing a balancer's loop: does the plan it applies pay, measured, against the plan it replaced?

A balancer plans from a model of the machine (calibrated coefficients, smoothed profiles). When the model stops
describing the machine (another job shares the cores, the links are busier than at start-up) the plan it
predicts to be faster can be slower. `PlanFeedback` watches the measured step time under both arms, the
balancer's plan ("plan") and its fallback ("base": static expert placement, the current stage partition), and
backs off to the base when the plan measures slower. A trial compares the two arms in one of two ways:

  interleaved (`interleave: true`, the default): after the warm-up step, 2 x `window` steps alternate the arms in
     pairs, base plan plan base base plan ... (each pair one step of each arm, every other pair in reverse order,
     so a load that rises or falls steadily favours neither arm); the plan is kept when the median over the
     pairs of plan time / base time is <= 1 + tolerance;
  windows (`interleave: false`): the run starts on the base arm and records `window` step times, then the plan
     arm runs `window` steps; the plan is kept when median(plan) <= (1 + tolerance) x median(base).
A failed trial backs off to the base for `hold` steps (doubled after every failed trial, at most `max_hold`),
then tries again with fresh measurements of both arms; a kept plan is re-checked every `recheck` steps (a new
trial), so a plan that stops paying (the machine's load changed) is found within one re-check period.

A balancer whose plans come at plan points (the layer balancer: a new partition costs a migration each way, so
its arms cannot alternate step by step) starts each trial itself (`auto=False`, always in windows): the base
window rolls over the latest steps of the current plan, `begin_trial` is called when a new plan is applied, a
kept plan becomes the base the next trial is compared with (no re-check: the planner re-plans from fresh
measurements every few steps), and a plan backed off from is replaced by the base again (the balancer migrates
back) and no trial starts during the hold (`can_try`).

Medians of a few steps do not let one slow step decide. Adjacent windows follow slow drifts of the machine, but
a machine shared with other jobs changes its load within seconds (a test suite starts, a build ends): a window
of base steps measured under one load and a window of plan steps under another can make a 10 % slower plan look
25 % faster, or the other way round. Pairs of adjacent steps see the same load, which is why interleaving is the
default. Every rank must feed the same numbers (the step time's maximum over the ranks
that apply the plan) so that every rank takes the same decision: the module is pure and deterministic.
The predictions the balancer made are recorded beside the measurements (`predicted_gain`, `measured_gain`), for
the dashboard and the docs, but do not decide: a prediction is what the loop is there to check.

Losses do not depend on the arm: both arms compute the same function (placement and partition only move work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from moebal.config import FeedbackConfig  # the schema lives with the typed config (planner.feedback)

__all__ = ["FeedbackConfig", "PlanFeedback"]

ARMS = ("base", "plan")
PAIRS = ("base", "plan", "plan", "base")
"""The arms of an interleaved trial, repeated: pairs of one step of each arm, every other pair reversed."""


@dataclass
class PlanFeedback:
    """The arm to run at each step, from the step times measured so far (module docstring)."""

    cfg: FeedbackConfig = field(default_factory=FeedbackConfig)
    arm: str = "base"
    """The arm of the next step."""
    until: int = 0
    """Step at which the current arm's stretch ends (a hold, a kept plan's re-check); 0: when its window is
    full; -1: never (a kept plan with `recheck: 0`)."""
    failures: int = 0
    """Consecutive failed trials (sets the hold)."""
    kept_since: int = 0
    """Step at which the plan was last kept (for the re-check)."""
    times: dict[str, list[float]] = field(default_factory=lambda: {a: [] for a in ARMS})
    """The current window of measured step times per arm."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Every decision: step, verdict, medians (seconds), hold; drained by the balancer into its plan log."""
    seen: int = 0
    trial: int = -1
    """Position in an interleaved trial (-1: not in one)."""
    auto: bool = True
    """True: the arms alternate by themselves; False: the balancer starts each trial (`begin_trial`), and a kept
    plan becomes the base (module docstring)."""

    def use_plan(self) -> bool:
        """Whether the next step runs the balancer's plan (else its base)."""
        return not self.cfg.enabled or self.arm == "plan"

    def wants_time(self) -> bool:
        """Whether the coming step's measured time will be used: a step of an interleaved trial, or any step
        when the windows roll. Outside a trial (the warm-up step, a hold after backing off, a kept plan until its
        re-check) an interleaved loop needs none, so the balancer spends no collective measuring it."""
        if not self.cfg.enabled:
            return False
        return self.trial >= 0 if self.cfg.interleave and self.auto else True

    def observe(self, step: int, seconds: float | None) -> None:
        """Step `step` ran on the arm `use_plan()` gave before it, in `seconds` (None where `wants_time()` said
        it was not needed)."""
        if not self.cfg.enabled:
            return
        if seconds is None and self.wants_time():
            raise ValueError(f"PlanFeedback: step {step} is a step of a trial and needs its measured time")
        self.seen += 1
        pairs = self.cfg.interleave and self.auto
        if self.seen == 1:  # warm-up: allocations and first-touch costs belong to no arm
            if pairs:
                self._begin_pairs()
            return
        if pairs:
            self._observe_pairs(step, seconds)
            return
        assert seconds is not None  # wants_time() is always true here
        w = self.times[self.arm]
        w.append(float(seconds))
        del w[:-self.cfg.window]  # a rolling window: a hold keeps the latest base steps for the next trial
        if not self.auto:
            self._observe_manual(step)
            return
        if self.until < 0:
            return  # kept for good (recheck 0)
        if self.until:
            if step >= self.until and self.arm == "base":  # a hold ends: try the plan again
                self._start_trial()
            elif step >= self.until:  # a kept plan's re-check: a fresh base window, then a trial
                self._switch("base", 0)
            return
        if len(w) < self.cfg.window:
            return
        if self.arm == "base":
            self._start_trial()
        else:
            self._judge(step)

    def _observe_manual(self, step: int) -> None:
        if self.arm == "base":
            if self.until and step >= self.until:
                self.until = 0  # the hold is over: the balancer may try a plan again
        elif len(self.times["plan"]) >= self.cfg.window:
            self._judge(step)

    def can_try(self, step: int) -> bool:
        """Whether the balancer may start a trial now (`auto=False`): on the base arm, outside a hold, with at
        least one base step measured to compare against; always when the loop is disabled."""
        if not self.cfg.enabled:
            return True
        return self.arm == "base" and not (self.until and step < self.until) and bool(self.times["base"])

    def begin_trial(self, step: int) -> None:
        """The balancer applied a new plan after step `step`: measure it for `window` steps (`auto=False`)."""
        if self.cfg.enabled:
            self._start_trial()

    def cancel(self) -> None:
        """The plan under trial and the base were both replaced (a forced migration, a re-pack): start over on
        the base arm with an empty window; a hold in progress continues."""
        self.arm = "base"
        self.times = {a: [] for a in ARMS}

    def _switch(self, arm: str, until: int) -> None:
        self.arm, self.until = arm, until
        self.times[arm] = []

    def _start_trial(self) -> None:
        self._switch("plan", 0)

    def _begin_pairs(self) -> None:
        self.trial, self.arm, self.until = 0, "base", 0
        self.times = {a: [] for a in ARMS}

    def _observe_pairs(self, step: int, seconds: float | None) -> None:
        if self.trial >= 0:
            assert seconds is not None  # wants_time() is true in a trial
            self.times[self.arm].append(float(seconds))
            self.trial += 1
            if self.trial < 2 * self.cfg.window:
                self.arm = PAIRS[self.trial % len(PAIRS)]
                return
            self.trial = -1
            ratio = median(p / b if b > 0 else 1.0 for b, p in zip(self.times["base"], self.times["plan"]))
            self._verdict(step, ratio)
        elif self.until > 0 and step >= self.until:  # a hold ends, or a kept plan's re-check is due
            self._begin_pairs()

    def _judge(self, step: int) -> None:
        base, plan = median(self.times["base"]), median(self.times["plan"])
        self._verdict(step, plan / base if base > 0 else 1.0)

    def _verdict(self, step: int, ratio: float) -> None:
        """Keep the plan or back off, from the plan's measured time over the base's (`ratio`)."""
        base, plan = median(self.times["base"]), median(self.times["plan"])
        ok = ratio <= 1.0 + self.cfg.tolerance
        event: dict[str, Any] = {"step": step, "verdict": "kept" if ok else "backed_off",
                                 "base_s": round(base, 6), "plan_s": round(plan, 6),
                                 "measured_gain": round(1.0 - ratio, 4)}
        if ok and not self.auto:  # the kept plan is the base of the next trial
            self.failures, self.kept_since = 0, step
            self.arm, self.until = "base", 0
            self.times = {"base": self.times["plan"], "plan": []}
        elif ok:
            self.failures, self.kept_since = 0, step
            self.arm, self.until = "plan", (step + self.cfg.recheck if self.cfg.recheck else -1)
        else:
            hold = min(self.cfg.hold * 2 ** self.failures, self.cfg.max_hold)
            self.failures += 1
            event["hold"] = hold
            self.arm, self.until = "base", step + hold
            self.times["base"] = []
        self.events.append(event)

    def drain(self) -> list[dict[str, Any]]:
        """Decisions made since the last call (for the balancer's `plans.jsonl` and the step's record)."""
        out, self.events = self.events, []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "until": self.until, "failures": self.failures, "kept_since": self.kept_since,
                "times": {a: list(v) for a, v in self.times.items()}, "seen": self.seen, "trial": self.trial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.arm, self.until = str(state["arm"]), int(state["until"])
        self.failures, self.kept_since = int(state["failures"]), int(state["kept_since"])
        self.times = {a: [float(x) for x in state["times"].get(a, [])] for a in ARMS}
        self.seen = int(state["seen"])
        self.trial = int(state.get("trial", -1))
