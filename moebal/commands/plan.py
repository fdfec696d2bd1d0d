"""`moebal plan TARGET`: run a planner in one process on recorded or synthetic statistics (a dry run).

Targets are registered in TARGETS (name -> module, help; moebal/commands/targets.py).
`experts` lives in this module; `stages`, `microbatches` and `memory` plug in with one line each.

Shape legend: L = MoE layers, R = ranks in the expert-parallel group, E = experts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.bench import at_least
from moebal.commands.targets import add_target_parsers, run_target
from moebal.errors import ConfigError
from moebal.fileio import complete_lines, read_json, read_text

TARGETS: dict[str, tuple[str, str]] = {
    "experts": ("moebal.commands.plan", "expert placement of MoE layers from a routing count matrix"),
    "stages": ("moebal.commands.plan_stages",
               "pipeline stage partitions of per-layer costs (uniform, partition, diffusion)"),
    "microbatches": ("moebal.commands.plan_microbatches",
                     "DynaPipe micro-batching of variable-length samples (dynamic, padding, packing, token-based) "
                     "with schedule and communication plan"),
    "memory": ("moebal.commands.plan_memory", "per-rank peak memory of a config on a cluster, by term; --fit: the "
               "smallest layout that fits"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_parsers(parser, TARGETS)


def run(args: argparse.Namespace) -> int:
    return run_target(args)


# ---- moebal plan experts -------------------------------------------------------------------------------------
def add_experts_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--counts", metavar="FILE", help="R x E token counts (source rank x expert): .json list of "
                   "lists (or L x R x E, or {'counts_RE': ...}), .npy, or a .jsonl log such as a run's "
                   "plans.jsonl (last line by default)")
    p.add_argument("--policy", default="all", choices=["prophet", "fastermoe", "static", "broadcast_topk", "all"],
                   help="placement policy to run (default: all, side by side); fastermoe = FasterMoE's shadowing "
                        "policy (its decision, costed with Pro-Prophet's model), not FasterMoE's system")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--costs", metavar="FILE", help="JSON object of MoELayerCosts fields (bytes, seconds); "
                   "default: the paper's RTX 3090 + 100 Gb/s IB constants for MoE-GPT-M")
    p.add_argument("--owner", help="owner rank of each expert, comma-separated (default: contiguous E/R blocks)")
    p.add_argument("--layer", type=int, help="only this layer of an L x R x E file")
    p.add_argument("--line", type=int, default=-1, help="record of a .jsonl file (default: the last)")
    p.add_argument("--alpha", type=float, default=0.0, help="prophet: eq. 7 early stop (0: search to the end)")
    p.add_argument("--n", default="0", help="prophet: low-count ranks excluded per expert; a comma list is searched")
    p.add_argument("--keep-zero", action="store_true", help="prophet: also send replicas to ranks with no tokens")
    p.add_argument("--overlap", action="store_true", help="cost with eq. 8 (Trans/Agg hidden under compute)")
    p.add_argument("--k", type=at_least(1), default=2, help="broadcast_topk: how many hottest experts (default 2)")
    p.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="the most replicas a rank receives per layer (planner.max_replicas; default: no cap)")
    p.add_argument("--config", metavar="CONFIG", help="dry run for a model (preset name or YAML, e.g. "
                   "mixtral-8x7b): costs from --cluster, counts synthetic unless --counts is given")
    p.add_argument("--cluster", default="h100", help="hardware profile for --config (name or path; default h100)")
    p.add_argument("--ranks", type=int, default=8, help="expert-parallel ranks for --config (default 8)")
    p.add_argument("--zipf", type=float, default=1.11, help="synthetic routing skew for --config (Zipf exponent; "
                   "1.11 makes the 3 hottest of 16 experts take half the tokens)")
    p.add_argument("--seed", type=int, default=0, help="synthetic routing seed for --config")
    p.add_argument("--bench", action="store_true", help="measure planner latency on synthetic skewed counts")
    p.add_argument("--bench-sizes", default="64x64,256x256", help="RANKSxEXPERTS list for --bench")
    p.add_argument("--repeats", type=at_least(1), default=31,
                   help="timed repeats per case for --bench (median reported)")


def run_experts(args: argparse.Namespace) -> int:
    from moebal.planner.placement import POLICIES

    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    if args.config:
        costs, synthetic = _dry_run(args)
    else:
        costs, synthetic = _load_costs(args.costs), None
    if args.bench:
        return _bench(args, costs, policies)
    if args.counts:
        layers = _load_counts(Path(args.counts), args.layer, args.line)
    elif synthetic is not None:
        if args.layer is not None and not 0 <= args.layer < len(synthetic):
            raise ConfigError(f"--layer {args.layer} outside 0..{len(synthetic) - 1}: the dry run of {args.config} "
                              f"has {len(synthetic)} MoE layers")
        layers = [(i, c) for i, c in enumerate(synthetic) if args.layer is None or i == args.layer]
    else:
        raise ConfigError("moebal plan experts needs --counts FILE, --config CONFIG (a dry run) or --bench")
    owner = _parse_ints(args.owner, "--owner") if args.owner else None
    report = [_plan_layer(idx, c_RE, costs, owner, policies, args) for idx, c_RE in layers]
    if args.json:
        print(json.dumps(_finite({"counts": args.counts, "layers": report}), indent=1, sort_keys=True))
    else:
        for layer in report:
            _print_layer(layer)
    return 0


def _dry_run(args: argparse.Namespace) -> tuple[Any, list[np.ndarray]]:
    """Costs of one MoE layer of a real model on a modelled cluster, and one step of seeded Zipf routing."""
    from moebal.interop.hf_config import load
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.sim.routing import SyntheticRouting

    cfg = load(args.config)
    E, R = cfg.moe.num_experts, args.ranks
    if E == 0:
        raise ConfigError(f"{args.config}: a dense model (moe.num_experts = 0) has no experts to place")
    if R < 1 or E % R:
        raise ConfigError(f"--ranks {R} must divide the {E} experts of {args.config}")
    shape = ModelShape.from_config(cfg)
    # each rank routes its share of the global batch (data.batch_size sequences over the R ranks), in the dtype
    # the run would send (train.precision; auto: bf16, as on a GPU)
    tokens = max(1, cfg.data.batch_size * cfg.data.seq_len // R)
    cost = CostModel(args.cluster, cfg.train.precision.replace("auto", "bf16"))
    costs = cost.moe_layer_costs(shape, list(range(R)), tokens, cfg.data.seq_len)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.model.n_layers))
    routing = SyntheticRouting(num_layers=moe_layers, num_experts=E, top_k=cfg.moe.top_k, zipf_s=args.zipf,
                               seed=args.seed)
    return costs, list(routing.counts(0, 1, R, tokens)[:, 0])


def _policy_options(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"overlap": args.overlap, "max_replicas": args.max_replicas}
    if policy == "prophet":
        ns = _parse_ints(args.n, "--n")
        opts.update(alpha=args.alpha, n=ns[0] if len(ns) == 1 else ns, exclude_zero=not args.keep_zero)
    elif policy == "broadcast_topk":
        opts["k"] = args.k
    return opts


def _plan_layer(idx: int | None, c_RE: np.ndarray, costs: Any, owner: list[int] | None, policies: list[str],
                args: argparse.Namespace) -> dict[str, Any]:
    from moebal.planner.placement import placement_metrics, plan_experts

    plans = []
    for policy in policies:
        t0 = time.perf_counter()
        plan = plan_experts(c_RE, policy, costs, owner, **_policy_options(policy, args))
        plan_s = time.perf_counter() - t0
        metrics = placement_metrics(c_RE, plan, costs, overlap=args.overlap)
        plans.append({"policy": policy, "plan_s": plan_s, "placement": plan.to_dict(), "metrics": metrics})
    load_E = c_RE.sum(axis=0)
    return {"layer": idx, "num_ranks": int(c_RE.shape[0]), "num_experts": int(c_RE.shape[1]),
            "tokens": float(load_E.sum()), "expert_max_over_mean": float(load_E.max() / max(load_E.mean(), 1e-30)),
            "plans": plans}


def _print_layer(layer: dict[str, Any]) -> None:
    title = "" if layer["layer"] is None else f"layer {layer['layer']}: "
    print(f"{title}{layer['num_ranks']} ranks x {layer['num_experts']} experts, {layer['tokens']:g} token-expert "
          f"assignments, expert load max/mean {layer['expert_max_over_mean']:.2f}")
    print(f"  {'policy':<15}{'predicted':>12}{'vs static':>10}{'replicas':>9}{'rank max/mean':>16}"
          f"{'RB':>7}{'A2A MB':>9}{'Trans MB':>9}")
    for p in layer["plans"]:
        m = p["metrics"]
        speed = m["static_time_s"] / m["predicted_time_s"] if m["predicted_time_s"] > 0 else 1.0
        print(f"  {p['policy']:<15}{_fmt_s(m['predicted_time_s']):>12}{speed:>9.2f}x{m['replicas']:>9}"
              f"{m['imbalance_before']:>8.2f}->{m['imbalance_after']:<6.2f}{m['rb']:>7.2f}"
              f"{m['a2a_bytes'] / 1e6:>9.3g}{m['trans_bytes'] / 1e6:>9.3g}")
    for p in layer["plans"]:
        reps = [(e, r) for e, r in enumerate(p["placement"]["replicas"]) if r]
        if not reps:
            continue
        print(f"  {p['policy']} replicas (expert -> ranks):")
        for e, r in reps[:16]:
            print(f"    E{e} (owner {p['placement']['owner'][e]}) -> {','.join(map(str, r))}")
        if len(reps) > 16:
            print(f"    ... {len(reps) - 16} more experts (--json lists all)")


def _fmt_s(t: float) -> str:
    if t >= 1.0:
        return f"{t:.4g} s"
    return f"{t * 1e3:.4g} ms" if t >= 1e-3 else f"{t * 1e6:.4g} us"


def _finite(x: Any) -> Any:
    """JSON has no Infinity/NaN: non-finite floats (an exact balance's infinite RB) become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers, e.g. 0,0,1,1") from None
    if not values:
        raise ConfigError(f"{flag} is empty: expected comma-separated integers")
    return values


def _load_costs(path: str | None) -> Any:
    from moebal.planner.perf import MoELayerCosts
    from moebal.planner.placement import DEFAULT_COSTS

    if path is None:
        return DEFAULT_COSTS
    data = read_json(path, "--costs")
    if not isinstance(data, dict):
        raise ConfigError(f"--costs {path}: expected a JSON object of MoELayerCosts fields")
    return MoELayerCosts.from_dict(data)


def _load_counts(path: Path, layer: int | None, line: int) -> list[tuple[int | None, np.ndarray]]:
    """[(layer index or None, counts_RE)] from .npy, .json or .jsonl; ConfigError on anything else."""
    if path.suffix == ".npy":
        try:
            data: Any = np.load(path, allow_pickle=False)
        except OSError as e:
            raise ConfigError(f"--counts {path}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:
            raise ConfigError(f"--counts {path}: cannot parse it ({e})") from None
    else:
        text = read_text(path, "--counts")
        if path.suffix == ".jsonl":
            lines = [ln for ln in complete_lines(text) if ln.strip()]  # a live run's: its last whole line
            if not lines:
                raise ConfigError(f"--counts {path}: the file has no records")
            try:
                text = lines[line]
            except IndexError:
                raise ConfigError(f"--counts {path}: --line {line} is out of range ({len(lines)} records)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--counts {path}: cannot parse it ({e})") from None
    data = _counts_field(data, path)
    try:
        arr = np.asarray(data, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"--counts {path}: counts must be a rectangular numeric R x E (or L x R x E) array") from None
    if arr.ndim == 2:
        if layer not in (None, 0):
            raise ConfigError(f"--counts {path}: holds one layer, --layer {layer} does not exist")
        return [(None, arr)]
    if arr.ndim != 3:
        raise ConfigError(f"--counts {path}: expected an R x E or L x R x E array, got shape {arr.shape}")
    if layer is None:
        return [(i, a) for i, a in enumerate(arr)]
    if not 0 <= layer < arr.shape[0]:
        raise ConfigError(f"--counts {path}: --layer {layer} outside 0..{arr.shape[0] - 1}")
    return [(layer, arr[layer])]


def _counts_field(data: Any, path: Path) -> Any:
    if not isinstance(data, dict):
        return data
    if "layers" in data and isinstance(data["layers"], list):
        return [_counts_field(d, path) for d in data["layers"]]
    for key in ("counts_RE", "counts_LRE", "counts"):
        if key in data:
            return data[key]
    if "expert_counts" in data:  # a run's metrics.jsonl: its counts are summed over the source ranks
        raise ConfigError(f"--counts {path}: this is a run's metrics log, whose expert_counts are summed over the "
                          f"ranks; give the run's plans.jsonl (per-rank counts of every layer, one record per plan)")
    raise ConfigError(f"--counts {path}: a JSON object needs a 'counts_RE', 'counts' or 'layers' field; "
                      f"found {sorted(data)}")


# ---- planner latency benchmark ---------------------------------------------------------------------------------
def _bench(args: argparse.Namespace, costs: Any, policies: list[str]) -> int:
    from moebal.planner.placement import plan_experts

    records = []
    for size in args.bench_sizes.split(","):
        try:
            R, E = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--bench-sizes {size!r}: expected RANKSxEXPERTS, e.g. 64x64") from None
        c_RE = _skewed_counts(R, E)
        for policy in policies:
            opts = _policy_options(policy, args)
            for _ in range(3):  # warm-up
                plan = plan_experts(c_RE, policy, costs, None, **opts)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan_experts(c_RE, policy, costs, None, **opts)
                times.append(time.perf_counter() - t0)
            records.append({"ranks": R, "experts": E, "policy": policy, "median_ms": 1e3 * float(np.median(times)),
                            "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times), "repeats": len(times),
                            "greedy_steps": plan.meta.get("steps"), "replicas": plan.num_replicas})
    env = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
           "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "counts": "per rank 4096 token-expert assignments, Zipf(1.2) expert popularity, seed 0",
           "costs": "default" if args.costs is None else args.costs, "options": _policy_options("prophet", args)}
    if args.json:
        print(json.dumps({"env": env, "records": records}, indent=1, sort_keys=True))
    else:
        print(f"planner latency (median of {args.repeats}; {env['counts']}; costs: {env['costs']})")
        for r in records:
            print(f"  {r['ranks']:>4} ranks x {r['experts']:>4} experts  {r['policy']:<15}"
                  f"{r['median_ms']:>8.3f} ms  (min {r['min_ms']:.3f}, max {r['max_ms']:.3f}; "
                  f"steps {r['greedy_steps']}, replicas {r['replicas']})")
    return 0


def _skewed_counts(R: int, E: int) -> np.ndarray:
    """Synthetic gating result: every rank routes 4096 assignments with the same Zipf-skewed popularity."""
    rng = np.random.default_rng(0)
    pop_E = 1.0 / np.arange(1, E + 1) ** 1.2
    pop_E = rng.permutation(pop_E / pop_E.sum())
    return rng.multinomial(4096, pop_E, size=R).astype(np.float64)
