"""What planning micro-batches on a dynamism scheme's costs is worth: plans on the scaled cost table against plans
on the dense one, both priced on the scaled one. Cost model only (no training run).

Under a dynamism scheme the micro-batch planner scales each stage's times in the cost table by the scheme's
prediction (`stage_scale`, docs/microbatching.md, "Dynamism schemes"). Here, per scenario and batch:
  scaled:  `plan_microbatches` on the table scaled per stage (what the runner plans with);
  dense:   `plan_microbatches` on the table without the scale (what it planned with before the scale);
both are then replayed through 1F1B on the scaled table (the stage times the run would have), and the report
gives how often the two plans' micro-batches differ and dense / scaled replayed time (above 1: the scaled plan
is predicted faster). Both plan with the 1F1B schedule alone, so the replay is the planner's own simulation of
the scaled plan (checked: equal to its predicted time).

Setting (defaults): the DynaPipe paper's 4-GPU GPT (16 layers, dim 4096, 3.35B; `plan_microbatches`'s
`_paper_gpt`) as 4 stages of 4 layers on A100s (the hardware-profile cost model, bf16), batches of 65,536 tokens
of FLAN-like lengths (log-normal, median 150, sigma 1.1), maximum length 2,048, as
`scripts/bench_microbatching.py` simulates it. The scenarios are stage scales of the shapes the schemes give
(illustrations, not measured ones): early exit (the later stages lighter), freezing (the first stages at a
third: forward only), Mixture-of-Depths (every stage alike) and a tilt (a scheme whose work falls with depth).

    python scripts/eval_scheme_scale.py [--batches 8] [--max-len 2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

import numpy as np

from moebal.commands.bench import at_least
from moebal.commands.plan_microbatches import _paper_gpt
from moebal.planner.adaptive_schedule import one_f_one_b, simulate
from moebal.planner.microbatch import MicroBatchPlan, plan_microbatches
from moebal.planner.microbatch_cost import MicroBatchCost, analytic_table, default_grid

SIZES = [4, 4, 4, 4]
SCENARIOS: dict[str, list[float]] = {
    "early_exit": [1.0, 1.0, 0.6, 0.3],
    "freezing": [1 / 3, 1 / 3, 1.0, 1.0],
    "mod": [0.73, 0.73, 0.73, 0.73],
    "tilt": [1.2, 1.0, 0.8, 0.6],
}
BATCH_TOKENS = 65536


def replay(plan: MicroBatchPlan, cost: MicroBatchCost) -> float:
    """The plan's micro-batches, in its injection order, through 1F1B on `cost`'s stage times."""
    rep = plan.replicas[0]
    mbs = [plan.micro_batches[i] for i in rep.micro_batches]
    f, b = cost.stage_times(np.asarray([m.size for m in mbs]), np.asarray([m.seq for m in mbs]))
    return float(simulate(one_f_one_b(cost.stages, list(range(len(mbs)))), f, b).makespan)


def batch_lengths(seed: int, k: int, max_len: int) -> np.ndarray:
    rng = np.random.default_rng([seed, k])
    lengths = np.clip(rng.lognormal(np.log(150), 1.1, 4000), 4, max_len).astype(int)
    return lengths[np.cumsum(lengths) <= BATCH_TOKENS]


def evaluate(scenarios: dict[str, list[float]], batches: int, max_len: int, seed: int = 0) -> list[dict[str, Any]]:
    b, s = default_grid(max_len, BATCH_TOKENS)
    dense = analytic_table(_paper_gpt(), "a100", SIZES, b, s, "bf16")
    rows = []
    for name, scale in scenarios.items():
        scaled = dense.scaled(scale)
        ratios, differ = [], 0
        for k in range(batches):
            lengths = batch_lengths(seed, k, max_len)
            p_scaled = plan_microbatches(lengths, scaled, max_len=max_len, schedules=("1f1b",))
            p_dense = plan_microbatches(lengths, dense, max_len=max_len, schedules=("1f1b",))
            t_scaled = replay(p_scaled, scaled)
            if not np.isclose(t_scaled, p_scaled.predicted_time_s, rtol=1e-9):
                raise AssertionError(f"{name}: the replay ({t_scaled}) is not the planner's simulation "
                                     f"({p_scaled.predicted_time_s})")
            differ += [m.rows for m in p_scaled.micro_batches] != [m.rows for m in p_dense.micro_batches]
            ratios.append(replay(p_dense, scaled) / t_scaled)
        rows.append({"scenario": name, "scale": [round(x, 4) for x in scale], "batches": batches,
                     "plans_differ": differ, "dense_over_scaled": [round(r, 4) for r in ratios],
                     "median": round(float(np.median(ratios)), 4), "min": round(min(ratios), 4),
                     "max": round(max(ratios), 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=at_least(1), default=8, help="batches per scenario (default 8)")
    ap.add_argument("--max-len", type=at_least(1), default=2048, help="longest sample (default 2048)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or args.batches < 1:
        ap.error(f"--scenarios: unknown {unknown}; choose among {list(SCENARIOS)}" if unknown
                 else f"--batches must be at least 1; got {args.batches}")
    rows = evaluate({n: SCENARIOS[n] for n in names}, args.batches, args.max_len, args.seed)
    for r in rows:
        print(f"{r['scenario']:<11} scale {r['scale']}: plans differ in {r['plans_differ']} of {r['batches']}, "
              f"dense / scaled time median {r['median']:.4f} (min {r['min']:.4f}, max {r['max']:.4f})",
              file=sys.stderr)
    report = {"setting": "DynaPipe GPT 3.35B, 4 stages on A100 (cost model, bf16), 65,536-token batches",
              "max_len": args.max_len, "seed": args.seed, "python": platform.python_version(), "rows": rows}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
