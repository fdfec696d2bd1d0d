"""Expert-parallel training step time under placement policies, real gloo ranks on this machine.

For each world size (2 ranks x 1 thread; 4 as well without --quick) one job trains an MoE-heavy model and,
interleaved in rounds, runs a few steps of every (routing, policy) pair:

  routing   balanced (the router as trained), skewed (a selection bias -s*log(expert id + 1) that makes the
            busiest expert's load at least 3x the mean), recorded (the per-expert shares of a real run's
            metrics.jsonl, reproduced with a selection bias; skipped without --recorded RUN_DIR)
  policy    static (plain expert parallelism), fastermoe (dynamic shadowing), prophet (Pro-Prophet greedy)

Each step = plan from the previous step's all-gathered counts, Trans, forward, backward, Agg, gradient sync,
optimizer step; the step time is the slowest rank's. The planner's coefficients are measured on the job
itself at start-up (moebal.dist.calibrate), so the planner and the measurement see the same machine.

    python scripts/bench_expert_parallel.py [--quick] [--json FILE] [--png FILE] [--recorded RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.commands.bench import add_device_argument, script_device
from moebal.config import Config, from_dict, to_dict
from moebal.dist.calibrate import describe, measure_layer_costs
from moebal.dist.expert_parallel import ExpertParallel
from moebal.dist.groups import ParallelDims
from moebal.dist.testing import run_ranks
from moebal.models import build_model
from moebal.planner.experts import ExpertPlanner, placement_metrics
from moebal.planner.plan import ExpertPlacement

CPU_ONLY = "it times gloo ranks on this machine's cores"
"""Why `--device` accepts cpu only here."""

POLICIES = ("static", "fastermoe", "prophet")


def bench_config(quick: bool) -> Config:
    """MoE-heavy: expert compute is most of the step, as in real MoE training."""
    return from_dict({
        "name": "bench-expert-parallel",
        "model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 1024, "max_seq_len": 128},
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 1024, "aux_loss_coef": 0.0},
        "data": {"seq_len": 128, "batch_size": 8},
        "train": {"precision": "fp32"},
    })


def skew_bias(E: int, strength: float) -> torch.Tensor:
    return -strength * torch.log(torch.arange(1, E + 1, dtype=torch.float32))


def recorded_bias(shares: list[float]) -> torch.Tensor:
    """A selection bias whose softmax reproduces the recorded per-expert shares (logits = log share)."""
    s = np.clip(np.asarray(shares, dtype=np.float64), 1e-6, None)
    return torch.tensor(np.log(s / s.sum()), dtype=torch.float32)


def _set_bias(model: torch.nn.Module, bias: torch.Tensor | None) -> None:
    for layer in model.moe_layers():
        layer.expert_bias = None if bias is None else bias.clone()


def _step(model, ep: ExpertParallel, opt, ids: torch.Tensor, placements: list[ExpertPlacement]) -> list[np.ndarray]:
    ep.apply(placements)
    out = model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    ep.aggregate()
    ep.sync_gradients()
    opt.step()
    opt.zero_grad(set_to_none=True)
    counts = []
    for layer in model.moe_layers():
        local = layer.last_stats.counts_E.clone()
        gathered = [torch.zeros_like(local) for _ in range(ep.dims.size("ep"))]
        dist.all_gather(gathered, local, group=ep.dims.group("ep"))
        counts.append(torch.stack(gathered).numpy().astype(np.float64))
    return counts


def _worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    cfg = from_dict(spec["config"])
    torch.manual_seed(0)
    model = build_model(cfg)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    ep = ExpertParallel(model, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(1234 + rank)
    costs = measure_layer_costs(ep.dispatchers[0], B * T * cfg.moe.top_k)
    routings = {"balanced": None, "skewed": skew_bias(cfg.moe.num_experts, spec["skew"])}
    if spec.get("recorded_shares"):
        routings["recorded"] = recorded_bias(spec["recorded_shares"])
    L, E = cfg.model.n_layers, cfg.moe.num_experts
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(spec["rounds"]):
        for routing, bias in routings.items():
            _set_bias(model, bias)
            for policy in POLICIES:
                planners = [ExpertPlanner(E, world, policy, costs, hysteresis=cfg.planner.hysteresis)
                            for _ in range(L)]
                placements = [p.current for p in planners]
                for i in range(spec["warmup"] + spec["steps"]):
                    ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
                    dist.barrier()
                    t0 = time.perf_counter()
                    counts = _step(model, ep, opt, ids, placements)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    t1 = time.perf_counter()
                    used = placements
                    placements = [p.step(c) for p, c in zip(planners, counts)]
                    plan_s = time.perf_counter() - t1
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if i >= spec["warmup"]:
                        samples.setdefault((routing, policy), []).append(
                            _sample(dt.item() + plan_s, plan_s, counts, used, costs))
    if rank:
        return []
    return [_record(routing, policy, world, s, costs, cfg) for (routing, policy), s in samples.items()]


def _sample(step_s: float, plan_s: float, counts: list[np.ndarray], used: list[ExpertPlacement], costs) -> dict:
    per_layer = [placement_metrics(c, p, costs) for c, p in zip(counts, used)]
    expert_loads = [c.sum(axis=0) for c in counts]
    return {"step_s": step_s, "plan_s": plan_s, "layers": per_layer,
            "expert_imbalance": float(np.mean([x.max() / x.mean() for x in expert_loads])),
            "replicas": sum(p.num_replicas for p in used)}


def _record(routing: str, policy: str, world: int, s: list[dict], costs, cfg: Config) -> dict[str, Any]:
    steps = [x["step_s"] for x in s]

    def mean_of(key: str) -> float:
        return float(np.mean([np.mean([layer[key] for layer in x["layers"]]) for x in s]))

    def total_of(key: str) -> float:
        return float(np.mean([sum(layer[key] for layer in x["layers"]) for x in s]))

    return {
        "policy": policy, "routing": routing, "world_size": world,
        "step_time_median_s": statistics.median(steps), "step_time_min_s": min(steps),
        "step_time_max_s": max(steps), "steps": len(steps),
        "expert_load_max_over_mean": float(np.mean([x["expert_imbalance"] for x in s])),
        "rank_load_max_over_mean_before": mean_of("imbalance_before"),
        "rank_load_max_over_mean_after": mean_of("imbalance_after"),
        "balance_degree_before": mean_of("balance_degree_before"),
        "balance_degree_after": mean_of("balance_degree_after"),
        "a2a_bytes_per_step": total_of("a2a_bytes"), "trans_bytes_per_step": total_of("trans_bytes"),
        "agg_bytes_per_step": total_of("agg_bytes"), "replicas_per_step": float(np.mean([x["replicas"] for x in s])),
        "planner_time_median_s": statistics.median(x["plan_s"] for x in s),
        "measured_costs": describe(costs),
    }


def recorded_shares(run_dir: Path) -> list[float] | None:
    """Per-expert shares (all MoE layers pooled) of the last logged steps of a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    counts = [r["expert_counts"] for r in rows if "expert_counts" in r][-20:]
    if not counts:
        return None
    pooled = np.sum([np.sum(np.asarray(c, dtype=np.float64), axis=0) for c in counts], axis=0)
    return (pooled / pooled.sum()).tolist()


def summarise(records: list[dict[str, Any]]) -> list[str]:
    by = {(r["world_size"], r["routing"], r["policy"]): r["step_time_median_s"] for r in records}
    lines = []
    for world in sorted({r["world_size"] for r in records}):
        limit = by.get((world, "balanced", "static"))
        for routing in ("balanced", "skewed", "recorded"):
            row = {p: by.get((world, routing, p)) for p in POLICIES}
            if row["static"] is None:
                continue
            cells = "  ".join(f"{p} {row[p]:.4f}s" for p in POLICIES if row[p] is not None)
            ratios = ""
            if routing != "balanced" and limit and row["prophet"]:
                ratios = (f"  prophet/limit {row['prophet'] / limit:.3f}"
                          f"  prophet/static {row['prophet'] / row['static']:.3f}"
                          f"  prophet/fastermoe {row['prophet'] / row['fastermoe']:.3f}")
            elif row["prophet"]:
                ratios = f"  prophet/static {row['prophet'] / row['static']:.3f}"
            lines.append(f"{world} ranks {routing:9s} {cells}{ratios}")
    return lines


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["world_size"], r["routing"]) for r in records})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        vals = [next((r["step_time_median_s"] for r in records if (r["world_size"], r["routing"]) == g
                      and r["policy"] == policy), math.nan) for g in groups]
        ax.bar(np.arange(len(groups)) + i * width, vals, width, label=policy)
    ax.set_xticks(np.arange(len(groups)) + width, [f"{w} ranks\n{r}" for w, r in groups])
    ax.set_ylabel("median step time (s)")
    ax.set_title("Expert-parallel step time by placement policy (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks only, fewer rounds")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("--png", type=Path, help="write a bar chart here (default: next to --json)")
    ap.add_argument("--recorded", type=Path, help="a run directory whose routing to replay")
    ap.add_argument("--skew", type=float, default=3.0, help="strength s of the skew bias -s*log(id+1)")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    cfg = bench_config(args.quick)
    spec = {"config": to_dict(cfg), "skew": args.skew, "rounds": 2 if args.quick else 3,
            "steps": 4 if args.quick else 6, "warmup": 2,
            "recorded_shares": recorded_shares(args.recorded) if args.recorded else None}
    if args.recorded and spec["recorded_shares"] is None:
        print(f"no per-expert counts in {args.recorded}/metrics.jsonl: skipping the recorded routing",
              file=sys.stderr)
    records: list[dict[str, Any]] = []
    for world in ([2] if args.quick else [2, 4]):
        records += run_ranks(_worker, world, spec, timeout_s=1800)[0]
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor(), "threads_per_rank": 1, "config": spec["config"],
            "skew": args.skew}
    for r in records:
        r["meta"] = meta
    for line in summarise(records):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1))
        plot(records, args.png or args.json.with_suffix(".png"))
    elif args.png:
        plot(records, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
