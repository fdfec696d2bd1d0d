"""Closing a balancer's loop: does the plan it applies pay, measured, against the plan it replaced?

A balancer plans from a model of the machine (calibrated coefficients, smoothed profiles). When the model stops
describing the machine (another job shares the cores, the links are busier than at start-up) the plan it
predicts to be faster can be slower. `PlanFeedback` watches the measured step time under both arms, the
balancer's plan ("plan") and its fallback ("base": static expert placement, the current stage partition), and
backs off to the base when the plan measures slower:

  1. the run starts on the base arm (a balancer has nothing to apply before its first observation) and records
     `window` step times; then the plan arm runs `window` steps (a trial);
  2. after a trial the medians are compared: the plan is kept when median(plan) <= (1 + tolerance) x
     median(base), else the balancer backs off to the base for `hold` steps (doubled after every failed trial,
     at most `max_hold`), then tries again with fresh windows of both arms;
  3. a kept plan is re-checked every `recheck` steps: `window` base steps, then a new trial, so a plan that
     stops paying (the machine's load changed) is found within one re-check period.

A balancer whose plans come at plan points (the layer balancer: a new partition costs a migration each way)
starts each trial itself (`auto=False`): the base window rolls over the latest steps of the current plan,
`begin_trial` is called when a new plan is applied, a kept plan becomes the base the next trial is compared
with (no re-check: the planner re-plans from fresh measurements every few steps), and a plan backed off from
is replaced by the base again (the balancer migrates back) and no trial starts during the hold
(`can_try`).

Medians of a few steps, compared only between adjacent windows, follow slow drifts of the machine without
letting one slow step decide. Every rank must feed the same numbers (the step time's maximum over the ranks
that apply the plan) so that every rank takes the same decision: the module is pure and deterministic.
The predictions the balancer made are recorded beside the measurements (`predicted_gain`, `measured_gain`), for
the dashboard and the docs, but do not decide: a prediction is what the loop is there to check.

Losses do not depend on the arm: both arms compute the same function (placement and partition only move work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

from moebal.errors import ConfigError

__all__ = ["FeedbackConfig", "PlanFeedback"]

ARMS = ("base", "plan")


@dataclass(kw_only=True, frozen=True)
class FeedbackConfig:
    """How a balancer checks its plans against measured time."""

    enabled: bool = True
    """False: apply every plan the planner makes (the open loop)."""
    tolerance: float = 0.02
    """Largest measured slowdown of the plan against the base accepted before backing off (0.02: 2 %)."""
    window: int = 4
    """Steps measured per arm before a comparison (the first step of each run is not counted: warm-up)."""
    hold: int = 32
    """Steps on the base arm after a failed trial; doubled after each consecutive failure ..."""
    max_hold: int = 512
    """... up to this many."""
    recheck: int = 100
    """Steps between re-checks of a kept plan (window base steps, then a trial); 0: never. (A balancer that
    starts its own trials, the layer balancer, re-plans at its plan points instead.)"""

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1 or self.window < 1 or self.hold < 1 or self.max_hold < self.hold \
                or self.recheck < 0:
            raise ConfigError(f"feedback: tolerance must be in [0, 1), window and hold >= 1, max_hold >= hold, "
                              f"recheck >= 0; got tolerance={self.tolerance}, window={self.window}, "
                              f"hold={self.hold}, max_hold={self.max_hold}, recheck={self.recheck}")


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
    auto: bool = True
    """True: the arms alternate by themselves (module docstring, 1-3); False: the balancer starts each trial
    (`begin_trial`), and a kept plan becomes the base."""

    def use_plan(self) -> bool:
        """Whether the next step runs the balancer's plan (else its base)."""
        return not self.cfg.enabled or self.arm == "plan"

    def observe(self, step: int, seconds: float) -> None:
        """The measured time of step `step`, which ran on the arm `use_plan()` gave before it."""
        if not self.cfg.enabled:
            return
        self.seen += 1
        if self.seen == 1:
            return  # warm-up: allocations and first-touch costs belong to no arm
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

    def _judge(self, step: int) -> None:
        base, plan = median(self.times["base"]), median(self.times["plan"])
        ok = plan <= (1.0 + self.cfg.tolerance) * base
        event: dict[str, Any] = {"step": step, "verdict": "kept" if ok else "backed_off",
                                 "base_s": round(base, 6), "plan_s": round(plan, 6),
                                 "measured_gain": round(1.0 - plan / base, 4) if base > 0 else 0.0}
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
                "times": {a: list(v) for a, v in self.times.items()}, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.arm, self.until = str(state["arm"]), int(state["until"])
        self.failures, self.kept_since = int(state["failures"]), int(state["kept_since"])
        self.times = {a: [float(x) for x in state["times"].get(a, [])] for a in ARMS}
        self.seen = int(state["seen"])
