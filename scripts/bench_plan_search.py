"""The micro-batch DP's bounded search against the DP at every candidate limit, side by side on large batches.

`dp_split` tries candidate limits on a micro-batch's time; each costs one DP over the batch (samples x longest
run). The bounded search (`moebal.planner.microbatch._search`) runs the DP at the limits whose bound can beat the
best found, SEARCH_GRID (64) per round; "every limit" is the same code with the grid unbounded (one round over
all of them: the plan before the search). Setting: the DynaPipe paper's 3.35B GPT on A100s (the hardware-profile
cost table, bf16, `moebal plan microbatches`' default), 4 stages, maximum length 4,096, thinning 0.01 (the
default), batches of N samples with log-normal lengths (median 600, sigma 0.9, clipped to 16..4,096; seed 0).
Per size: the split's wall time by variant (the order rotates each repeat; median and every round), the
candidate limits and how many the search evaluated, and whether both give the same micro-batches and Eq1.

    python scripts/bench_plan_search.py [--sizes 250,1000,2200] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moebal.planner.microbatch as mb  # noqa: E402
from moebal.commands.plan_microbatches import paper_table  # noqa: E402

VARIANTS = {"search": mb.SEARCH_GRID, "every limit": 10 ** 9}


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.9, n), 16, 4096).astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="250,1000,2200", help="samples per batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size, variants rotated (default 3)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.repeats < 1 or any(n < 1 for n in sizes):
        ap.error("--repeats and every size must be at least 1")
    cost = paper_table(4, 4096)
    rows = []
    for n in sizes:
        L = np.sort(lengths(n))[::-1]
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        results = {}
        names = list(VARIANTS)
        for r in range(args.repeats):
            for name in names[r % 2:] + names[:r % 2]:
                mb.SEARCH_GRID = VARIANTS[name]
                t0 = time.perf_counter()
                results[name] = mb.dp_split(L, cost, 4, thin=0.01)
                times[name].append(time.perf_counter() - t0)
        mb.SEARCH_GRID = VARIANTS["search"]
        fast, full = results["search"], results["every limit"]
        row = {"samples": n, "tokens": int(L.sum()), "candidates": full.candidates, "evaluated": fast.evaluated,
               "same_plan": fast.runs == full.runs, "objective_s": {"search": fast.objective,
                                                                   "every limit": full.objective},
               "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
               "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()}}
        row["speedup"] = round(row["median_s"]["every limit"] / row["median_s"]["search"], 2)
        rows.append(row)
        print(f"{n:>5} samples ({row['tokens']:,} tokens): {row['evaluated']} of {row['candidates']} limits, "
              f"search {row['median_s']['search']:.3f} s, every limit {row['median_s']['every limit']:.3f} s "
              f"({row['speedup']}x), same plan: {row['same_plan']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": "paper GPT 3.35B, a100 bf16, 4 stages, max_len 4096, "
                                                          "thin 0.01", "repeats": args.repeats, "rows": rows},
                                              indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
