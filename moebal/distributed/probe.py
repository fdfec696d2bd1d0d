"""The alpha-beta link probe: latency and bandwidth of a link from the times of two message sizes.

A transfer of S bytes is modelled as alpha + S / beta (alpha: latency in seconds, beta: bandwidth in bytes/s).
`probe_link` times a caller's transfer (a point-to-point round trip, an all-reduce) on a float32 buffer of
each size with the shared timing helper (`moebal.kernels.bench.time_fn`: a warm-up call, then the median of
`repeats`, the device synchronised around each call), lets the ranks agree on the times (by default the
slowest rank's, so every rank plans from identical numbers), and fits the line through the two points.
Two sizes far apart (a few KiB and a few MiB) separate the two terms: a single small message mostly measures
latency, and a bandwidth read from it makes every large transfer look too dear.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moebal.kernels.bench import time_fn
from moebal.sync import to_host

__all__ = ["LARGE_BYTES", "SMALL_BYTES", "LinkFit", "fit_link", "probe_link", "slowest_over"]

SMALL_BYTES = 16 << 10
"""Default small message: its time is mostly latency."""
LARGE_BYTES = 4 << 20
"""Default large message: its time is mostly bytes over bandwidth."""


@dataclass(frozen=True)
class LinkFit:
    """A link as alpha + bytes / beta."""

    latency_s: float
    """alpha: seconds of a zero-byte transfer."""
    bandwidth: float
    """beta: bytes per second."""

    def seconds(self, nbytes: float) -> float:
        """Predicted time of one transfer of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth


def fit_link(small_bytes: float, small_s: float, large_bytes: float, large_s: float) -> LinkFit:
    """The line through (small_bytes, small_s) and (large_bytes, large_s); a non-increasing pair (timing
    noise) is read as a very fast link rather than a negative bandwidth, and the latency is never negative."""
    if not 0 <= small_bytes < large_bytes:
        raise ValueError(f"the probe's sizes must satisfy 0 <= small < large; got {small_bytes} and {large_bytes}")
    beta = (large_bytes - small_bytes) / max(large_s - small_s, 1e-9)
    return LinkFit(latency_s=max(0.0, small_s - small_bytes / beta), bandwidth=beta)


def slowest_over(group: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """An `agree` for `probe_link`: every rank of `group` (None: the default group) adopts the largest times."""

    def agree(times: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return times

    return agree


def probe_link(transfer: Callable[[torch.Tensor], None], device: torch.device,
               sizes: Sequence[int] = (SMALL_BYTES, LARGE_BYTES), repeats: int = 5, legs: int = 1,
               agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LinkFit:
    """Latency and bandwidth of the link `transfer(buffer)` uses, from its median time on a float32 buffer of
    each of the two `sizes` (bytes). `legs`: how many times one call crosses the link (2 for a round trip).
    `agree` maps this rank's float64 times (one per size, on `device`) to the times every rank fits from
    (`slowest_over(group)`; None: this rank's own). Every rank of the link must call it alike."""
    if len(sizes) != 2 or repeats < 1 or legs < 1:
        raise ValueError(f"probe_link needs two sizes, repeats >= 1 and legs >= 1; got sizes={list(sizes)}, "
                         f"repeats={repeats}, legs={legs}")
    times = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        times.append(time_fn(partial(transfer, buf), warmup=1, repeats=repeats, device=device).median / legs)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if agree is not None:
        t = agree(t)
    small_s, large_s = to_host(t, "link probe times")
    return fit_link(sizes[0], small_s, sizes[1], large_s)
