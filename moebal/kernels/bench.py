"""The one timing helper every moebal benchmark and calibration uses: warm-up, repeats, median, min, max.

`time_interleaved` runs several methods round-robin inside one process, so slow drifts of a shared machine
(other jobs, frequency changes) hit every method alike and ratios stay honest. `sample_interleaved` gives the
raw seconds (for callers that combine them across ranks).

On an accelerator a call only queues kernels: given `device`, every timed call is bracketed by a device
synchronisation (`torch.cuda.synchronize`), so a figure is the work's duration, not its launch time. Given
`autocast`, every call runs under `torch.autocast(device type, autocast)`, entered per call as a training step
does (so the casts autocast caches within a region are paid per call, too): time the precision the run trains
in (`moebal.train.precision.autocast_dtype`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of one method over `repeats` timed calls (and the process CPU seconds of the same
    calls: on a shared machine, where other jobs stretch wall time, CPU time still tracks the work done)."""

    median: float
    min: float
    max: float
    repeats: int
    cpu_median: float = float("nan")
    cpu_min: float = float("nan")
    samples: tuple[float, ...] = ()
    """Every timed call's wall seconds, in round order: the figures above can be re-derived from them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (CUDA; elsewhere a call's work is done when it returns)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _precision(device: torch.device | str | None, autocast: torch.dtype | None) -> Any:
    if autocast is None:
        return contextlib.nullcontext()
    if device is None:
        raise ValueError(f"timing under autocast={autocast} needs the device whose autocast to enter: pass device")
    return torch.autocast(torch.device(device).type, dtype=autocast)


def summarise(samples: list[float], cpu_samples: list[float] | None = None) -> Timing:
    cpu = cpu_samples or [float("nan")]
    return Timing(median=statistics.median(samples), min=min(samples), max=max(samples), repeats=len(samples),
                  cpu_median=statistics.median(cpu), cpu_min=min(cpu), samples=tuple(samples))


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 5, device: torch.device | str | None = None,
            autocast: torch.dtype | None = None) -> Timing:
    """Time `fn()` (synchronising the device around each call; under `autocast` when given)."""
    return time_interleaved({"fn": fn}, warmup=warmup, repeats=repeats, device=device, autocast=autocast)["fn"]


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 5,
                     device: torch.device | str | None = None, autocast: torch.dtype | None = None
                     ) -> dict[str, Timing]:
    """Time several methods round-robin: each round calls every method once, in a rotated order."""
    wall, cpu = sample_interleaved(fns, warmup=warmup, repeats=repeats, device=device, autocast=autocast)
    return {name: summarise(wall[name], cpu[name]) for name in fns}


def sample_interleaved(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 5,
                       device: torch.device | str | None = None, autocast: torch.dtype | None = None,
                       before: Callable[[], Any] | None = None
                       ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process CPU seconds of each call of `time_interleaved`'s rounds; `before` runs ahead of each
    timed call, outside the timed region (a barrier, so that ranks start a collective together)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            with _precision(device, autocast):
                fns[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if before is not None:
                before()
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            with _precision(device, autocast):
                fns[name]()
            _sync(device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def environment() -> dict[str, Any]:
    """Hardware and versions to record next to every figure."""
    from moebal.train.precision import bf16_native  # here: moebal.train imports the kernels package

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        # what `train.precision: auto` resolves to here: the same benchmark computes in bf16 on one 2-core EPYC
        # and in fp32 on another, and the CPU name does not tell them apart
        "cpu_bf16_native": bf16_native(torch.device("cpu")),
    }
    if torch.cuda.is_available():
        env["cuda_device"] = torch.cuda.get_device_name(0)
        env["cuda_bf16_native"] = bf16_native(torch.device("cuda"))
    return env
