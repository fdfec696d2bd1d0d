"""What one `run_ranks` call costs (moebal/distributed/testing.py): ranks started by spawn against ranks forked
by the forkserver, for a function that does one all-reduce (start-up, process group, shutdown: nothing else).

Each round times `--repeats` calls per (start method, world size), the methods' order alternating by round;
the forkserver's first call, which starts the server and imports torch and moebal there, is reported on its
own and left out of the medians. The default settings are those the test suite uses (1 thread per rank).

    python scripts/bench_run_ranks.py [--rounds 2] [--repeats 2] [--worlds 2 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moebal.commands.bench import at_least
from moebal.distributed.testing import START_METHOD_ENV, run_ranks

METHODS = ("spawn", "forkserver")


def _all_reduce(rank: int, world: int) -> float:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _call(method: str, world: int) -> float:
    """Seconds for one run_ranks call under `method`; checks its result."""
    os.environ[START_METHOD_ENV] = method
    t0 = time.perf_counter()
    out = run_ranks(_all_reduce, world)
    seconds = time.perf_counter() - t0
    assert out == [float(world)] * world, out
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=2, help="calls per method, world size and round")
    ap.add_argument("--worlds", type=at_least(1), nargs="+", default=[2, 4], help="world sizes")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    first = {f"forkserver_first_call_{args.worlds[0]}_ranks_s": _call("forkserver", args.worlds[0])}
    times: dict[str, list[list[float]]] = {f"{m}/{w}": [] for m in METHODS for w in args.worlds}
    for r in range(args.rounds):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            for w in args.worlds:
                times[f"{method}/{w}"].append([_call(method, w) for _ in range(args.repeats)])
    result: dict[str, Any] = {
        "settings": vars(args), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), **first,
        "rounds_s": {k: [[round(s, 3) for s in rnd] for rnd in v] for k, v in times.items()},
        "median_s": {k: round(statistics.median(s for rnd in v for s in rnd), 3) for k, v in times.items()}}
    for w in args.worlds:
        med = result["median_s"]
        result[f"speedup_{w}_ranks"] = round(med[f"spawn/{w}"] / med[f"forkserver/{w}"], 1)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
