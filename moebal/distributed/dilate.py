"""Emulated devices slower than a core: a benchmark device for hosts with fewer cores than ranks.

With more ranks than cores, the OS time-slices the ranks: a rank that reaches a collective first waits for a
peer that is still waiting for a core, and an idle rank lends its core to the busy ones, which no GPU can do.
Wall-clock comparisons then measure the host's scheduler as much as the system under test.

Dilation by a factor d > 1 makes every span of compute between two points where a rank meets other ranks
(a collective issued or waited for, a message sent, a gradient handed to the communication thread) last d x
its CPU time: the rank sleeps out the rest before it reaches the meeting point, as a device d times slower
than a core would reach it later. With d > ranks / cores the ranks never ask for more than the cores have:
compute is not time-sliced against other ranks, a waiting rank wakes as soon as its peer arrives, and the
communication threads (gloo moves and reduces bytes on the CPU) find a core free, as a NIC or a DMA engine
would be. The rule is d x CPU time minus the wall time already spent, so a span that the OS already stretched
(another job on the machine) is not stretched twice.

Only a benchmark device for CPU hosts: on CUDA the device is real and dilation is refused by its callers.
"""

from __future__ import annotations

import threading
import time

__all__ = ["DeviceClock", "settle"]


def settle(factor: float, cpu_s: float, t0: float) -> float:
    """Sleep until `factor` x `cpu_s` seconds after `t0` (a perf_counter time); returns the seconds slept."""
    rest = factor * cpu_s - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)
        return rest
    return 0.0


class DeviceClock:
    """The compute thread's span since its last meeting point, dilated by `factor` at the next one.

    `mark()` starts a span (on the thread that computes; a blocking wait ends with one, so waiting is never
    dilated); `settle()` ends it: sleeps out `factor` x its CPU time and starts the next. Calls from any other
    thread (a completion callback) are ignored: only the compute thread's time is the device's."""

    def __init__(self, factor: float = 1.0) -> None:
        if not factor >= 1.0:
            raise ValueError(f"dilation factor must be >= 1 (1: off); got {factor}")
        self.factor = float(factor)
        self.slept_s = 0.0
        """Seconds slept since the last `reset_slept()`: the emulated device's extra compute time."""
        self._thread: int | None = None
        self._t0 = self._c0 = 0.0

    @property
    def on(self) -> bool:
        return self.factor > 1.0

    def mark(self) -> None:
        if self.on:
            self._thread = threading.get_ident()
            self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def settle(self) -> None:
        if self.on and self._thread == threading.get_ident():
            self.slept_s += settle(self.factor, time.thread_time() - self._c0, self._t0)
            self.mark()

    def reset_slept(self) -> float:
        s, self.slept_s = self.slept_s, 0.0
        return s
