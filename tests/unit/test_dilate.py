"""Emulated slow devices (`moebal.distributed.dilate`): fake clocks; nothing depends on the machine's speed."""

from __future__ import annotations

import threading

import pytest

from moebal.distributed import dilate
from moebal.scheduler import BackgroundOp, CommScheduler


class FakeTime:
    """perf_counter, thread_time and sleep on one fake clock: `work(s)` is s seconds of CPU (and wall)."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0
        self.slept: list[float] = []

    def work(self, s: float) -> None:
        self.wall += s
        self.cpu += s

    def wait(self, s: float) -> None:  # blocked: wall time passes, no CPU
        self.wall += s

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 9))
        self.wall += s


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    f = FakeTime()
    monkeypatch.setattr(dilate.time, "perf_counter", lambda: f.wall)
    monkeypatch.setattr(dilate.time, "thread_time", lambda: f.cpu)
    monkeypatch.setattr(dilate.time, "sleep", f.sleep)
    return f


def test_a_span_lasts_factor_times_its_cpu_time(fake: FakeTime) -> None:
    clock = dilate.DeviceClock(3.0)
    clock.mark()
    fake.work(0.2)
    clock.settle()
    assert fake.slept == [0.4]  # 0.2 s of CPU ends 0.6 s after the mark
    fake.work(0.1)
    clock.settle()  # settle starts the next span
    assert fake.slept == [0.4, 0.2]
    assert clock.reset_slept() == pytest.approx(0.6) and clock.slept_s == 0.0


def test_time_the_os_already_took_is_not_dilated_twice(fake: FakeTime) -> None:
    clock = dilate.DeviceClock(3.0)
    clock.mark()
    fake.work(0.2)
    fake.wait(0.3)  # descheduled: the span's wall time is already 0.5 s of the 0.6 s
    clock.settle()
    assert fake.slept == [pytest.approx(0.1)]
    clock.mark()
    fake.work(0.1)
    fake.wait(1.0)  # stretched beyond 3x already: no sleep
    clock.settle()
    assert len(fake.slept) == 1


def test_factor_one_is_off_and_other_threads_are_ignored(fake: FakeTime) -> None:
    off = dilate.DeviceClock(1.0)
    off.mark()
    fake.work(1.0)
    off.settle()
    clock = dilate.DeviceClock(2.0)
    clock.mark()
    fake.work(0.5)
    t = threading.Thread(target=clock.settle)  # a completion callback is not the device
    t.start()
    t.join()
    assert fake.slept == []
    clock.settle()
    assert fake.slept == [0.5]
    with pytest.raises(ValueError, match="dilation factor must be >= 1"):
        dilate.DeviceClock(0.5)


def test_the_scheduler_dilates_compute_before_each_collective_and_hand_off_never_a_wait(fake: FakeTime) -> None:
    """Compute before a collective, before a gradient chunk is handed over and before the step's end is
    dilated; the time blocked in a wait or in drain is not."""
    sched = CommScheduler("lina", timeout_s=10, dilate=3.0)
    try:
        sched.begin_step([BackgroundOp("allreduce", "dp_ep allreduce 0", 1024, lambda: None, group="dp_ep",
                                       chunk=0)])
        sched.start_compute()
        fake.work(0.1)  # forward up to the all-to-all
        h = sched.issue("a2a", lambda: None, name="L0 dispatch0", nbytes=64)
        assert fake.slept == [pytest.approx(0.2)]
        fake.wait(5.0)  # as if blocked inside the wait below: wait() starts a new span at its end
        h.wait()
        fake.work(0.05)  # backward up to the gradient hand-off
        sched.ready(0)
        assert fake.slept[-1] == pytest.approx(0.1)
        fake.work(0.02)
        sched.drain()
        assert fake.slept[-1] == pytest.approx(0.04)
        fake.work(0.03)  # the optimizer step
        sched.settle()
        assert fake.slept[-1] == pytest.approx(0.06)
        assert sched.clock.slept_s == pytest.approx(0.4)
    finally:
        sched.close()
