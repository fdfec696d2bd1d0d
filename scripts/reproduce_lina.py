"""Reproduce Lina's training result in the simulator: step-time speedup from prioritising all-to-all over
all-reduce (and from partitioning both into micro-ops) on 16 A100s.

    python scripts/reproduce_lina.py [--json FILE] [--png FILE] [--steps 3]

Paper (Li Jiamin's thesis, chapter 4, = Lina, USENIX ATC'23): 4 nodes x 4 A100 40GB, 100 Gb/s InfiniBand, one
expert per GPU, top-2, DeepSpeed-MoE baseline whose all-reduce and all-to-all share the network uncoordinated.
Fig. 4.14 (no expert packing): priority alone gains 24 % on average (10-30 %); priority + tensor partitioning
1.42x for 16 experts (1.36x, 1.36x, 1.41x for 2, 4, 8). Table 4.1: with 16 experts the 12-layer, 419M-parameter
Transformer-XL spends 333 ms per step in all-to-all, 39.5 % of the step.

How it is simulated (the gaps the thesis leaves are named in docs/simulator.md):
- model: Transformer-XL-like, 12 layers, d_model 512, FFN 2048 (d=512 and 2,048 are what make Table 4.1's
  419M parameters with 16 experts per layer), 8 heads, sequence 512, two-matrix experts, fp16;
- tokens per GPU: not given; chosen ONCE so that the baseline's simulated all-to-all time per step equals
  Table 4.1's 333 ms, then held fixed for every variant (the speedups are not fitted);
- routing: near-uniform (the thesis: the balancing loss makes training routing close to uniform), multinomial;
- baseline: gradients in 25 MB DDP buckets all-reduced as they become ready, overlapping the backward pass and
  its all-to-alls on the same links; priority: a bucket is issued only while no all-to-all is registered on the
  rank (Lina's look-ahead included); + partitioning: 30 MB per-gradient chunks instead of buckets and each
  all-to-all split in two token chunks pipelined with the experts. Expert packing is not modelled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GPUS = 16
SEQ = 512
PAPER_A2A_S = 0.333
PAPER = {"priority": 1.24, "priority+partition": 1.42}
SEED = 0


def shape() -> Any:
    from moebal.planner.cost import ModelShape

    return ModelShape(dim=512, n_layers=12, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=2048, vocab_size=204,
                      num_experts=GPUS, top_k=2, expert_ffn_dim=2048, expert_matrices=2)


def spec(variant: str, batch: int) -> Any:
    from moebal.sim.program import Layout, SimSpec

    base = {"layout": Layout(GPUS, ep=GPUS), "micro_batch_size": batch, "seq_len": SEQ, "bucket_bytes": 25e6,
            "grad_bytes": 2}
    if variant == "baseline":
        return SimSpec(**base)
    if variant == "priority":
        return SimSpec(**base, lina_priority=True)
    return SimSpec(**base, lina_priority=True, ar_chunk_bytes=30e6, moe_schedule="lina", a2a_chunks=2)


def run(variant: str, batch: int, steps: int) -> dict[str, float]:
    from moebal.planner.cost import CostModel
    from moebal.sim.routing import SyntheticRouting
    from moebal.sim.simulate import simulate

    sh, cost = shape(), CostModel("a100", "fp16")
    routing = SyntheticRouting(num_layers=sh.n_layers, num_experts=GPUS, top_k=2, zipf_s=0.0, drift=0.0, seed=SEED)
    t, a2a, ar = [], [], []
    for step in range(1, steps + 1):
        res = simulate(sh, cost, spec(variant, batch), routing.counts(step, 1, GPUS, batch * SEQ), keep_engine=False)
        t.append(res.iteration_time_s)
        a2a.append(res.comm_s.get("a2a", 0.0))
        ar.append(res.comm_s.get("allreduce", 0.0))
    return {"iteration_s": statistics.mean(t), "a2a_s": statistics.mean(a2a), "allreduce_s": statistics.mean(ar)}


def fit_batch() -> int:
    """Sequences per GPU whose baseline all-to-all time per step is closest to Table 4.1's 333 ms."""
    best = None
    for batch in range(1, 65):
        a2a = run("baseline", batch, 1)["a2a_s"]
        if best is None or abs(a2a - PAPER_A2A_S) < abs(best[1] - PAPER_A2A_S):
            best = (batch, a2a)
        if a2a > PAPER_A2A_S:
            break
    assert best is not None
    return best[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--png", default=None, metavar="FILE")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    batch = fit_batch()
    runs = {v: run(v, batch, args.steps) for v in ("baseline", "priority", "priority+partition")}
    base = runs["baseline"]
    records = []
    for variant, paper in PAPER.items():
        sim = base["iteration_s"] / runs[variant]["iteration_s"]
        records.append({"variant": variant, "paper": paper, "simulated": sim, "rel_error": (sim - paper) / paper,
                        "config": {"gpus": GPUS, "profile": "a100", "dtype": "fp16", "seq_len": SEQ,
                                   "sequences_per_gpu": batch, "steps": args.steps}})
    a2a_share = base["a2a_s"] / base["iteration_s"]
    summary = {"sequences_per_gpu": batch, "baseline": base, "runs": runs,
               "baseline_a2a_share": a2a_share, "paper_a2a_share": 0.395, "wall_s": round(time.perf_counter() - t0, 1)}
    for r in records:
        print(f"{r['variant']:<20} paper {r['paper']:.2f}x  simulated {r['simulated']:.3f}x")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "records": records}, indent=1), encoding="utf-8")
    if args.png:
        plot(records, runs, args.png)
    return 0


def plot(records: list[dict[str, Any]], runs: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["variant"] for r in records]
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [r["paper"] for r in records], 0.4, alpha=0.45, label="paper")
    axes[0].bar([i + 0.2 for i in x], [r["simulated"] for r in records], 0.4, label="simulated")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_xticks(list(x), names)
    axes[0].set(title="Lina on 16 A100: step-time speedup", ylabel="speedup over DeepSpeed-MoE")
    axes[0].legend()
    v = list(runs)
    axes[1].bar(v, [runs[k]["iteration_s"] * 1e3 for k in v], label="step")
    axes[1].bar(v, [runs[k]["a2a_s"] * 1e3 for k in v], 0.5, label="inside all-to-all (per rank)")
    axes[1].set(title="simulated step", ylabel="ms")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
