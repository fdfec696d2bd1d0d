"""CPU worker threads for expert kernels: run disjoint pieces of work with one intra-op thread each.

Why: per-expert GEMMs are small, and each multi-threaded op ends in a barrier. With T intra-op threads, a loop
over E experts pays about 9 * E barriers per forward + backward, and on a shared machine every barrier can wait
for a descheduled thread. Splitting the rows across T single-threaded workers instead leaves three barriers
per forward + backward and no idle spinning inside GEMMs.

The pool is a process-wide execution resource (like torch's own thread pools), created lazily and recreated
after a fork; it holds no model or training state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] = (0, 0)  # (pid, workers)


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's pool, with at least `workers` threads. It only grows (a smaller call uses some of its
    threads; they start lazily), so a process that varies its worker count holds one pool, not one per count;
    the pool it outgrows is shut down (its threads exit once their work is done)."""
    global _pool, _pool_key
    with _lock:
        pid = os.getpid()
        if _pool is None or _pool_key[0] != pid or _pool_key[1] < workers:
            if _pool is not None and _pool_key[0] == pid:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moebal-expert")
            _pool_key = (pid, workers)
        return _pool


def _single_threaded(fn: Callable[[], None]) -> None:
    torch.set_num_threads(1)
    with torch.no_grad():  # grad mode is per thread; kernel work inside an autograd Function records nothing
        fn()


def cpu_workers(rows: int, device: torch.device, min_rows: int = 64) -> int:
    """How many workers to split `rows` over: the intra-op thread count on CPU, 1 elsewhere or when small."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), rows // min_rows))


def run_parallel(tasks: Sequence[Callable[[], None]]) -> None:
    """Run the tasks concurrently, one per thread, each with one intra-op thread; the caller runs the first.

    Tasks are kernel work (they run without autograd recording). The intra-op thread count is restored
    afterwards, also when a task raises.
    """
    if len(tasks) <= 1:
        for task in tasks:
            task()
        return
    pool = _executor(len(tasks) - 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        futures = [pool.submit(_single_threaded, task) for task in tasks[1:]]
        try:
            tasks[0]()
        finally:
            for f in futures:
                f.result()  # waits for every task; re-raises a task's exception
    finally:
        torch.set_num_threads(previous)
