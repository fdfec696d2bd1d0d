"""Pro-Prophet's block overlap inside pipeline stages: step time with and without it, on real gloo ranks.

    python scripts/bench_pipeline_overlap.py [--quick] [--rounds 3] [--steps 24] [--settle 4] [--dilate 3]
                                             [--link-mbit 1000] [--json FILE]

One job of 4 gloo ranks (2 stages x 2 expert shards, 1 thread each) trains one MoE model twice, side by side in
the same processes, one step of each variant in turn (the order alternates every step, so the load of a shared
machine hits both alike):

  off   `scheduler.block_overlap: false`: each stage's Trans of every MoE layer before the step, its Agg after
        the last backward, both waited for in place
  on    `scheduler.block_overlap: true`: Trans of each next MoE layer as the layer before it starts its first
        micro-batch, Agg inside the stage's last backward (docs/pipeline.md)

Both plan with eq. 8 (`planner.overlap` on the first), so they make the same placements and compute the same
losses (checked): only when Trans and Agg go out differs. Routing is skewed (a selection bias -s log(1 + e),
each MoE layer its own permutation of the experts) so that Pro-Prophet replicates hot experts every step; the
planner's coefficients come from a fixed hardware profile (`planner.costs`), so both variants' plans are the
same whatever the machine's load.

Devices (`--dilate`, default 3): every forward and backward op lasts 3 x its CPU time (`pipeline.dilate`), as on
devices 3x slower than a core: 4 ranks then ask 2 cores for at most 4/3 of them, and the transfers (gloo's
threads) find a core free, as a NIC would. Without dilation (`--dilate 1`) 4 ranks time-slice 2 cores and an
overlapped transfer competes with the compute it hides under.

The network (`--link-mbit`, default 1,000): the ranks run on two "nodes", Linux network namespaces joined by a
veth pair shaped to that rate in each direction (moebal/launch/netns.py, as scripts/bench_comm_schedule.py
does; needs root and iproute2), rank r on node r % 2. A stage's two ranks sit on different nodes, so its
all-to-alls, Trans and Agg cross the link, while the pipeline's messages between stages stay inside a node. The
rate is chosen so that a step's Trans and Agg (about 21 MB each way per stage) cost a share of the step
comparable to its compute; `--link-mbit 0` (or no root) runs over loopback.

Reported per round: each variant's median step time over the steps after `--settle`, off / on, the replicas
per step; and the median of the rounds' ratios. JSON out with every round and step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.commands.bench import at_least
from moebal.config import Config, from_dict, to_dict
from moebal.distributed.testing import run_ranks
from moebal.launch.netns import mark_started, rank_worker, run_shaped, unavailable

VARIANTS = ("off", "on")


def bench_cfg(dilate: float, steps: int) -> Config:
    """2 stages x 2 expert shards of a 4-layer MoE (8 experts of 3 x 256 x 1,024: 3 MB per replica in fp32),
    4 micro-batches of 2 rows of 128 tokens per stage rank."""
    return from_dict({
        "model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 512, "max_seq_len": 128},
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 1024, "kernel": "loop", "aux_loss_coef": 0.0},
        "data": {"seq_len": 128, "batch_size": 16, "max_bytes": 2_000_000},
        "train": {"steps": steps, "warmup_steps": 2, "lr": 1e-3, "eval_every": 0, "precision": "fp32",
                  "threads": 1},
        "parallel": {"pp": 2, "ep": 2, "nproc": 4},
        "planner": {"policy": "prophet", "costs": "rtx3090", "hysteresis": 0.0},
        "pipeline": {"micro_batches": 4, "dilate": dilate}})


def _variant(cfg: Config, name: str) -> Config:
    on = name == "on"
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, block_overlap=on),
                               planner=dataclasses.replace(cfg.planner, overlap=not on))


def _skew(runner: Any, strength: float) -> None:
    """A selection bias per MoE layer of this stage: -strength x log(1 + rank of the expert in the layer's
    permutation), the permutation drawn from the layer's global index (the same on every rank)."""
    for i in runner.stage.layer_ids:
        layer = runner.stage.layer(i)
        if layer.is_moe:
            moe = layer.block_sparse_moe
            perm = np.random.default_rng(i).permutation(moe.num_experts)
            moe.expert_bias = -strength * torch.log1p(torch.as_tensor(perm, dtype=torch.float32))


def worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from moebal.config import from_dict
    from moebal.pipeline.runner import PipelineRunner

    torch.set_num_threads(1)
    cfg = from_dict(spec["config"])
    out: dict[str, Any] = {"rounds": []}
    for rnd in range(spec["rounds"]):
        runners = {v: PipelineRunner(_variant(cfg, v)) for v in VARIANTS}
        for r in runners.values():
            _skew(r, spec["skew"])
            r.start()
        mark_started(spec, rank)
        records: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for step in range(cfg.train.steps):
            order = VARIANTS if (step + rnd) % 2 == 0 else VARIANTS[::-1]
            for v in order:
                rec = runners[v].train_step()
                records[v].append({k: rec[k] for k in ("step", "loss", "step_time_s") if k in rec}
                                  | {"replicas": rec.get("replicas", [])})
        for r in runners.values():
            r.close()
        out["rounds"].append(records)
    return out


def _all_ranks(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """`worker` on every rank, every rank's result gathered to all (rank 0 writes them: `rank_worker`)."""
    import torch.distributed as dist

    mine = worker(rank, world, spec)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return every


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of 6 steps (2 settling)")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--steps", type=at_least(1), default=24)
    ap.add_argument("--settle", type=at_least(0), default=4, help="first steps left out of the medians")
    ap.add_argument("--dilate", type=float, default=3.0)
    ap.add_argument("--skew", type=float, default=1.0, help="strength s of the selection bias -s log(1 + e)")
    ap.add_argument("--link-mbit", type=float, default=1000.0,
                    help="rate of the link between the two nodes' namespaces (0: loopback, no namespaces)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rank-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        return rank_worker(*args.rank_worker, _all_ranks)
    if args.quick:
        args.rounds, args.steps, args.settle = 1, 6, 2
    if args.steps <= args.settle:
        ap.error(f"--steps ({args.steps}) must exceed --settle ({args.settle}): medians are of the steps after it")
    if not args.dilate >= 1:
        ap.error(f"--dilate must be >= 1 (1: off); got {args.dilate}")
    t0 = time.perf_counter()
    cfg = bench_cfg(args.dilate, args.steps)
    spec = {"config": to_dict(cfg), "rounds": args.rounds, "skew": args.skew}
    why = unavailable() if args.link_mbit > 0 else "loopback requested"
    if why is None:
        results, retried = run_shaped(__file__, 4, spec, args.link_mbit, tag=f"po{os.getpid()}", subnet=94,
                                      port=29671)
        network = f"{args.link_mbit:g} Mbit/s veth between two network namespaces"
    else:
        results, retried, network = run_ranks(worker, 4, spec, timeout_s=7200), [], f"loopback ({why})"
    print(f"network: {network}", flush=True)
    rank0 = results[0]["rounds"]
    rounds = []
    for rnd, recs in enumerate(rank0):
        # the step's time is the slowest rank's
        t = {v: [max(r["rounds"][rnd][v][s]["step_time_s"] for r in results) for s in range(args.steps)]
             for v in VARIANTS}
        med = {v: statistics.median(t[v][args.settle:]) for v in VARIANTS}
        same = all(a["loss"] == b["loss"] for a, b in zip(recs["off"], recs["on"]))
        replicas = statistics.mean(sum(x["replicas"]) for x in recs["on"][args.settle:])
        rounds.append({"median_step_s": med, "off_over_on": med["off"] / med["on"], "losses_equal": same,
                       "replicas_per_step": replicas, "step_times_s": t})
        print(f"round {rnd + 1}: off {med['off'] * 1e3:.1f} ms, on {med['on'] * 1e3:.1f} ms per step, "
              f"off / on {med['off'] / med['on']:.3f}; losses equal {same}; replicas per step {replicas:.1f}",
              flush=True)
    ratios = [r["off_over_on"] for r in rounds]
    summary = {"off_over_on_rounds": ratios, "off_over_on_median": statistics.median(ratios),
               "losses_equal": all(r["losses_equal"] for r in rounds)}
    print(f"off / on per round {', '.join(f'{x:.3f}' for x in ratios)}; median {summary['off_over_on_median']:.3f}")
    if args.json:
        res = {"machine": f"{platform.machine()}, torch {torch.__version__}, gloo, 4 ranks x 1 thread",
               "network": network, "startup_failures_retried": retried,
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "config": spec["config"], "rounds": rounds, "summary": summary,
               "wall_s": time.perf_counter() - t0}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
