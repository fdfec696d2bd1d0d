"""`moebal plan memory`: each rank's peak memory for a config on a cluster, by term, and whether it fits.

    moebal plan memory CONFIG --cluster PROFILE --ranks N [--pp P --ep E --shard S --recompute R]
                       [--micro-batches M] [--policy P] [--init full|local] [--fit] [--json]

The plan is moebal/planner/memory.py (pure arithmetic; docs/memory.md). `--fit` proposes the smallest layout
that fits: the fewest ranks (powers of two up to a node, then whole nodes doubling, up to --ranks), then the
least overhead (`moebal.planner.memory.overhead`). `--cluster cpu` plans against this machine's RAM shared by
--ranks ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from moebal.config import refuse_flag_and_override
from moebal.errors import ConfigError
from moebal.planner.memory import (
    RECOMPUTES,
    SHARDS,
    DeviceMemory,
    MemoryPlan,
    choose_shard,
    fit_layout,
    layout_from_config,
    plan_memory,
    refusal_line,
)

__all__ = ["add_memory_arguments", "device_for", "format_plan", "run_memory"]


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="model YAML or preset name (mixtral-8x7b, llama-moe-3.5b)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. data.batch_size=64")
    p.add_argument("--cluster", default="h100", help="hardware profile (name or YAML path), or 'cpu' for this "
                   "machine's RAM (default h100)")
    p.add_argument("--ranks", type=int, help="ranks in the job (default: parallel.nproc, at least pp x ep; with "
                   "--fit: the most to try, default 4096)")
    p.add_argument("--pp", type=int, help="pipeline stages (default parallel.pp)")
    p.add_argument("--ep", type=int, help="expert-parallel size (default parallel.ep, or every rank of a stage)")
    p.add_argument("--shard", choices=(*SHARDS, "auto"), help="sharded model state (default parallel.shard; auto: "
                   "the least sharding that fits, as `moebal train` settles parallel.shard auto)")
    p.add_argument("--recompute", choices=RECOMPUTES, help="activation recomputation (default train.recompute)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per step: a pipeline's (default "
                   "pipeline.micro_batches), without one gradient accumulation's (default train.grad_accum)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "zb"), help="pipeline schedule (default pipeline.schedule)")
    p.add_argument("--policy", choices=("static", "prophet", "fastermoe", "broadcast_topk"),
                   help="expert placement policy, which bounds the replicas (default planner.policy)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="compute precision (default train.precision; "
                   "auto is bf16 on a GPU profile)")
    p.add_argument("--init", choices=("full", "local"), help="start-up: full = every rank builds the whole model "
                   "first, local = only its share (the default: moebal/models/local_init.py)")
    p.add_argument("--skew", type=float, default=1.0, help="busiest rank's routed rows / the mean (default 1)")
    p.add_argument("--fit", action="store_true", help="propose the smallest layout that fits")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def device_for(cluster: str, ranks: int) -> DeviceMemory:
    """The memory of one rank of `cluster`: a hardware profile, or 'cpu' (this machine's RAM / ranks)."""
    if cluster == "cpu":
        return DeviceMemory.cpu(host_ram_bytes(), ranks)
    from moebal.planner.hardware import load_profile

    return DeviceMemory.from_profile(load_profile(cluster), ranks)


def host_ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to plan against
        raise ConfigError("cannot read this machine's RAM size (os.sysconf): give --cluster PROFILE") from None


def _per_node(cluster: str) -> int:
    if cluster == "cpu":
        return 1 << 20
    from moebal.planner.hardware import load_profile

    return load_profile(cluster).gpus_per_node


def run_memory(args: argparse.Namespace) -> int:
    from moebal.interop.hf_config import load

    for name in ("ranks", "pp", "ep", "micro_batches"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {v}")
    if not (math.isfinite(args.skew) and args.skew >= 1.0):  # a skew below 1 shrank the activations to "fits"
        raise ConfigError(f"--skew is the busiest rank's routed rows / the mean, so at least 1; got {args.skew}")
    refuse_flag_and_override(args, args.overrides, (
        ("pp", "parallel.pp"), ("ep", "parallel.ep"), ("shard", "parallel.shard"), ("recompute", "train.recompute"),
        ("schedule", "pipeline.schedule"), ("policy", "planner.policy"), ("precision", "train.precision"),
        ("ranks", "parallel.nproc")))
    cfg = load(args.config, list(args.overrides))
    # the default holds the layout's own stages and expert-parallel group (a preset of ep 8 on one rank is no job)
    least = (args.pp or cfg.parallel.pp) * (args.ep or cfg.parallel.ep or 1)
    ranks = args.ranks or (4096 if args.fit else max(cfg.parallel.nproc or 1, least))
    changes: dict[str, Any] = {"pp": args.pp, "ep": args.ep, "shard": args.shard, "recompute": args.recompute,
                               "micro_batches": args.micro_batches, "schedule": args.schedule, "policy": args.policy,
                               "precision": args.precision, "init": args.init, "routing_skew": args.skew}
    if args.fit:
        if (args.shard or cfg.parallel.shard) == "auto":  # the search tries every shard value itself
            changes["shard"] = "none"
        base = layout_from_config(cfg, 1, **{**changes, "pp": 1, "ep": 1})
        device = device_for(args.cluster, 1)
        plan = fit_layout(cfg, device, base, ranks, per_node=_per_node(args.cluster))
        if plan is None:
            raise ConfigError(f"no layout of {cfg.name} fits on up to {ranks} ranks of {device.name}: raise --ranks, "
                              f"lower data.batch_size or data.seq_len, or use a smaller model")
    else:
        device = device_for(args.cluster, ranks)
        if (args.shard or cfg.parallel.shard) == "auto":
            precision = args.precision or cfg.train.precision.replace("auto", "bf16")
            cfg, line = choose_shard(cfg, ranks, device, precision,
                                     **{k: v for k, v in changes.items() if k != "precision"})
            changes["shard"] = cfg.parallel.shard
            print(line, file=sys.stderr)
        plan = plan_memory(cfg, layout_from_config(cfg, ranks, **changes), device)
    if args.json:
        out = plan.to_dict()
        out["config"] = cfg.name
        if not plan.fits:
            out["refusal"] = refusal_line(cfg, plan)
        print(json.dumps(out, indent=1))
    else:
        print("\n".join(format_plan(plan, cfg.name)))
        if not plan.fits:
            print(refusal_line(cfg, plan))
    return 0 if plan.fits else 1


def format_plan(plan: MemoryPlan, name: str) -> list[str]:
    """The per-rank table of terms (GB) and the verdict."""
    gb = 1e9
    lay = plan.layout
    stage = f", stage {plan.stage} of {lay.pp} (the largest)" if lay.pp > 1 else ""
    lines = [f"{name}: {lay.describe()}, policy {lay.policy}, init {lay.init}; per rank{stage}, {plan.device.name}"]
    for k, v in plan.terms.items():
        lines.append(f"  {k:<32}{v / gb:10.2f} GB")
    for k, v in plan.phases.items():
        lines.append(f"  phase {k:<26}{v / gb:10.2f} GB")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  peak per rank {plan.peak_bytes / gb:.2f} GB of {plan.device.capacity_bytes / gb:.2f} GB: {verdict}"
                 f" (largest term: {plan.largest_term[0]})")
    return lines
