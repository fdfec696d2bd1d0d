"""The micro-batch planner's own time on large batches: `plan_microbatches` (method 'dynamic', the default) and its
DP split (`dp_split`) alone.

Setting as scripts/bench_plan_search.py: the DynaPipe paper's 3.35B GPT on A100s (the hardware-profile cost table,
bf16, max tokens 8 x 4,096: `moebal plan microbatches`' default), 4 stages, maximum length 4,096, thinning 0.01,
batches of N samples with log-normal lengths (median 600, sigma 0.9, clipped to 16..4,096; seed 0). Per size: the
wall and process CPU seconds of each (one warm-up, then median, min and max of the repeats), the micro-batches,
the candidate limits and how many the search evaluated, and a digest of the plan (sha256 of its JSON without its
timing) by which plans of two source trees compare (run the script with each tree on PYTHONPATH).

    python scripts/bench_plan_microbatches.py [--sizes 256,1024,4096] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.plan_microbatches import paper_table
from moebal.planner.microbatch import dp_split, plan_microbatches


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.9, n), 16, 4096).astype(np.int64)


def seconds(fn: Any, repeats: int) -> tuple[Any, list[float], list[float]]:
    """fn's result and the wall and process CPU seconds of each timed call (the planner runs on one thread: on a
    shared machine its CPU seconds are the steadier figure)."""
    out = fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return out, wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024,4096", help="samples per batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per size and function (default 3)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.repeats < 1 or any(n < 1 for n in sizes):
        ap.error("--repeats and every size must be at least 1")
    cost = paper_table(4, 4096)
    rows = []
    for n in sizes:
        L = lengths(n)
        plan, *plan_s = seconds(lambda L=L: plan_microbatches(L, cost), args.repeats)
        _, *split_s = seconds(lambda L=L: dp_split(np.sort(L)[::-1], cost, 4), args.repeats)
        d = plan.to_dict()
        d["meta"].pop("plan_s")
        row = {"samples": n, "tokens": int(L.sum()), "micro_batches": len(plan.micro_batches),
               "candidates": plan.meta["candidates"], "evaluated": plan.meta["candidates_evaluated"],
               "plan_digest": hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]}
        for name, (wall, cpu) in (("plan", plan_s), ("split", split_s)):
            row[f"{name}_s"] = {"median": round(statistics.median(wall), 4), "min": round(min(wall), 4),
                                "max": round(max(wall), 4), "all": [round(x, 4) for x in wall],
                                "cpu_median": round(statistics.median(cpu), 4), "cpu_all": [round(x, 4) for x in cpu]}
        rows.append(row)
        print(f"{n:>5} samples: plan {row['plan_s']['median']:.3f} s (CPU {row['plan_s']['cpu_median']:.3f} s), "
              f"split {row['split_s']['median']:.3f} s (CPU {row['split_s']['cpu_median']:.3f} s), medians of "
              f"{args.repeats}; {row['micro_batches']} micro-batches, {row['evaluated']} of {row['candidates']} "
              f"limits, plan {row['plan_digest']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": "paper GPT 3.35B, a100 bf16, 4 stages, max_len 4096, "
                                                          "max_tokens 32768, thin 0.01", "repeats": args.repeats,
                                               "python": sys.version.split()[0], "numpy": np.__version__,
                                               "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
