"""Run a function on several real gloo ranks (for tests and small benchmarks).

The function must be importable by reference (a module-level function). Each rank runs it as
`fn(rank, world_size, *args)`; results come back in rank order. A failing rank makes the whole call raise
with that rank's traceback; the others are stopped instead of waiting in a collective.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from moebal.dist.launch import free_port

__all__ = ["run_ranks"]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, q: Any, threads: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              threads: int = 1) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; the list of their return values."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start processes of its own (background micro-batch planners); the finally
    # below joins or terminates every rank whatever happens.
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, q, threads), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = q.get(timeout=timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(results))} gave no result within "
                                   f"{timeout_s:.0f}s (exited without reporting: {dead})") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    return [results[r] for r in range(world_size)]
