"""Communication scheduling: Lina's prioritised, chunked all-to-all and all-reduce, Pro-Prophet's block overlap."""

from moebal.scheduler.core import (
    MODES,
    BackgroundOp,
    CommScheduler,
    Completion,
    Forecast,
    Handle,
    SchedulerError,
    completion_for,
)
from moebal.scheduler.events import (
    CRITICAL,
    CommEvent,
    EventLog,
    Span,
    StepComm,
    check_order,
    chrome_trace,
    step_record,
    write_chrome_trace,
)
from moebal.scheduler.exchange import ExchangePlan, expert_exchange
from moebal.scheduler.grads import GradGroup, GradSync

__all__ = [
    "CRITICAL", "MODES", "BackgroundOp", "CommEvent", "CommScheduler", "Completion", "EventLog", "ExchangePlan",
    "Forecast", "GradGroup", "GradSync", "Handle", "SchedulerError", "Span", "StepComm", "check_order", "chrome_trace",
    "completion_for", "expert_exchange", "step_record", "write_chrome_trace",
]
