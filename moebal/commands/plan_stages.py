"""`moebal plan stages`: stage partitions of per-layer costs, in one process (a dry run of the layer planner).

    moebal plan stages --costs 1,1,1,1,0.5,0.5,0.2,0.2 --stages 4 [--memory FILE] [--capacity BYTES] [--json]

Costs are per-layer seconds (or any unit) as a comma list or a JSON file (a list, or an object with `costs`,
as a `plans.jsonl` line of a pipeline run holds under `meta.costs`; a .jsonl file: its last line). Every
balancer runs side by side: uniform (Megatron), partition (exact min-max by the given costs: by time for
measured times, DeepSpeed's `parameters` method for parameter counts), diffusion (from --from, default
uniform), and with --repack the fewest stages within --slack of the best.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moebal.errors import ConfigError
from moebal.fileio import read_text
from moebal.planner.partition import (
    diffuse,
    imbalance,
    iteration_time,
    migration_layers,
    partition_by_time,
    partition_uniform,
    plan_repack,
    stage_loads,
)

__all__ = ["add_stages_arguments", "run_stages"]


def add_stages_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", required=True, help="per-layer costs: a comma list or a JSON file")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages")
    p.add_argument("--memory", help="per-layer bytes: a comma list or a JSON file (with --capacity)")
    p.add_argument("--capacity", type=float, help="bytes a stage may hold")
    p.add_argument("--from", dest="current",
                   help="current layers per stage: a comma list or a JSON file (a plans.jsonl line: its from) "
                        "(default: uniform)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per iteration (default 8)")
    p.add_argument("--first-extra", type=float, default=0.0, help="embedding cost, pinned to the first stage")
    p.add_argument("--last-extra", type=float, default=0.0, help="head cost, pinned to the last stage")
    p.add_argument("--comm", type=float, default=0.0, help="one boundary transfer, in the costs' unit")
    p.add_argument("--repack", action="store_true", help="also plan the fewest stages within --slack")
    p.add_argument("--slack", type=float, default=0.1, help="re-pack: accepted slowdown (default 0.1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a comma list longer than a file name may be (ENAMETOOLONG) names no file
        return False


def _numbers(text: str, flag: str, key: str) -> list[float]:
    """A comma list, a JSON list, or the list `key` of a JSON object (or of its `meta`, as a plans.jsonl line
    holds it: the last line of a .jsonl file)."""
    path = Path(text)
    if path.suffix in (".json", ".jsonl") or _is_file(path):
        text_ = read_text(text, flag)
        try:
            if path.suffix == ".jsonl":  # a run's plans.jsonl: the last plan's costs
                text_ = [ln for ln in text_.splitlines() if ln.strip()][-1]
            data: Any = json.loads(text_)
        except (json.JSONDecodeError, IndexError) as e:
            raise ConfigError(f"{flag} {text}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("meta", data)
            data = data.get(key)
        if not isinstance(data, list):
            raise ConfigError(f"{flag} {text}: expected a list of numbers or an object with {key!r}")
        values = data
    else:
        values = [v for v in text.split(",") if v.strip()]
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"{flag}: expected numbers, e.g. 1,0.5,0.25; got {text!r}") from None


def run_stages(args: argparse.Namespace) -> int:
    costs = _numbers(args.costs, "--costs", "costs")
    memory = _numbers(args.memory, "--memory", "memory") if args.memory else None
    if args.capacity is not None and memory is None:
        raise ConfigError("--capacity needs --memory (per-layer bytes)")
    P, M = args.stages, args.micro_batches
    for flag, value, least in (("--stages", P, 1), ("--micro-batches", M, 1), ("--first-extra", args.first_extra, 0),
                               ("--last-extra", args.last_extra, 0), ("--comm", args.comm, 0),
                               ("--slack", args.slack, 0)):
        if not value >= least:  # NaN too
            raise ConfigError(f"{flag} must be at least {least}; got {value}")
    kw = {"first_extra": args.first_extra, "last_extra": args.last_extra}
    current = ([int(v) for v in _numbers(args.current, "--from", "from")] if args.current
               else partition_uniform(len(costs), P))
    if len(current) != P or sum(current) != len(costs) or min(current) < 1:
        raise ConfigError(f"--from {args.current}: give {P} layer counts (one per stage, each at least 1) that add up "
                          f"to the {len(costs)} layers of --costs")
    plans = {
        "uniform": partition_uniform(len(costs), P),
        "partition": partition_by_time(costs, P, memory=memory, capacity=args.capacity,
                                       current=current, **kw),
        "diffusion": diffuse(costs, current, memory=memory, capacity=args.capacity, **kw),
    }
    if args.repack:
        packed = plan_repack(costs, P, M, args.slack, memory=memory, capacity=args.capacity, comm_s=args.comm, **kw)
        if packed is not None:
            plans["repack"] = packed
    base = iteration_time(stage_loads(costs, plans["uniform"], **kw), M, args.comm)
    report: list[dict[str, Any]] = []  # JSON rows
    for name, sizes in plans.items():
        loads = stage_loads(costs, sizes, **kw)
        t = iteration_time(loads, M, args.comm)
        report.append({"balancer": name, "sizes": sizes, "loads": [round(x, 6) for x in loads],
                       "max_load": max(loads), "imbalance": round(imbalance(loads), 4), "iteration_time": t,
                       "speedup_vs_uniform": round(base / t, 4) if t > 0 else None,
                       "moves_from_current": len(migration_layers(current, sizes)) if len(sizes) == P else None})
    if args.json:
        print(json.dumps({"layers": len(costs), "stages": P, "micro_batches": M, "plans": report}, indent=1))
        return 0
    print(f"{len(costs)} layers on {P} stages, {M} micro-batches (iteration time = (M-1) max + sum + transfers)")
    print(f"  {'balancer':<10}{'sizes':<28}{'max load':>10}{'max/mean':>10}{'iteration':>12}{'vs uniform':>11}")
    for r in report:
        speedup = "-" if r["speedup_vs_uniform"] is None else f"{r['speedup_vs_uniform']:.3f}x"  # no work at all
        print(f"  {r['balancer']:<10}{','.join(map(str, r['sizes'])):<28}{r['max_load']:>10.4g}{r['imbalance']:>10.3f}"
              f"{r['iteration_time']:>12.4g}{speedup:>11}")
    return 0
