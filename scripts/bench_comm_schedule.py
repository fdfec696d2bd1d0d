"""Communication scheduling on real gloo ranks: unscheduled vs Lina vs Lina + Pro-Prophet block overlap.

    python scripts/bench_comm_schedule.py [--quick] [--json FILE] [--png FILE] [--no-sim] [--preset P]
                                          [--link-mbit M|0] [--bucket-mb B] [--modes ...] [--set key=value]

For 2 ranks (expert parallel over both) and 4 ranks (2 expert-parallel x 2 data-parallel, so the expert
gradients are all-reduced too) one job builds the same MoE model three times, one per mode, and runs them
interleaved step by step (every round runs one step of every mode, in a rotated order, so outside load hits
all alike):

  unscheduled   gradients in buckets all-reduced as soon as they are ready, concurrent with the all-to-alls
                (PyTorch DDP's behaviour; its 25 MB buckets, about one block of a large model, scaled to this
                model: --bucket-mb, default the preset's); Trans and Agg blocking
  lina          gradient chunks issued only while no all-to-all is queued or in flight (chunk size and token
                chunks per layer from the cost model measured on the job); Trans and Agg blocking
  lina+overlap  lina plus Pro-Prophet's block overlap (Trans of layer l+1 under layer l, Agg under the
                backward) and the planner costing plans with eq. 8
  serial        reference: the gradients all-reduced after the backward pass (no overlap, no contention)

Every mode trains with the Pro-Prophet planner on skewed routing (a selection bias that makes the busiest
expert about 3x the mean), so Trans and Agg happen. A step is apply placements + forward + backward + Agg +
gradient sync + AdamW, timed from a barrier; per step and rank the scheduler's event log gives

  a2a_time_s       time with an all-to-all (or count exchange) in flight: what concurrent gradient traffic
                   slows down (Lina's "all-to-all time")
  a2a_shared_s     time with an all-to-all and a gradient all-reduce chunk in flight together: whether the
                   configuration has the contention the comparison is about
  exposed_comm_s   time the compute thread waited on communication of any kind
  step_time_s      the slowest rank's step

and the figures are medians over steps of the mean over ranks (step time: of the slowest rank).

The network: by default (root and iproute2 available) the ranks run on two "nodes", Linux network namespaces
joined by a veth pair (moebal.launch.netns) whose two directions are each shaped to --link-mbit (default: the
preset's; a token-bucket qdisc): rank r lives on node r % 2, so every expert-parallel group and the stage's gradient
all-reduce cross the link, while the 4-rank run's expert-gradient groups stay inside a node. All-to-all and
all-reduce then compete for one bandwidth-limited link, as an all-to-all and DDP's all-reduce compete for a
NIC (Lina's setting), and the qdisc that enforces the rate costs no compute. With --link-mbit 0 (or without
root) the ranks talk over loopback: there the "link" is the two cores themselves, which also compute, so
communication moved out of an all-to-all lands on compute instead and the comparison says little about
networks. 4 ranks share 2 cores (two per core): their absolute times are not device times.

Presets (PRESETS): `contended` (default), the situation the target metric names: an MoE layer in every
other block (GShard's and DeepSpeed-MoE's GPT layout) on a 300 Mbit/s link, where the unscheduled mode's
buckets are in flight during the next MoE block's backward all-to-alls; `balanced`, the control configuration
(an MoE layer in every block, 1 Gbit/s), where they barely meet. --set key=value overrides a model key.

Start-up in the namespaces: gloo's connection set-up there now and then aborts a rank before any step runs
(see `moebal.launch.netns.run_shaped`); such an attempt is retried in fresh namespaces (at most
STARTUP_ATTEMPTS), the reason printed and kept in every record (`startup_failures_retried`); a failure after
start-up stops the run.

Without --no-sim the script also runs the simulated comparison on Lina's cluster (scripts/reproduce_lina.py:
16 A100, 100 Gb/s InfiniBand) and appends its records (kind "simulated").
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

import numpy as np
import torch
import torch.distributed as dist

from moebal.commands.bench import add_device_argument, script_device
from moebal.config import Config, from_dict, to_dict, with_overrides
from moebal.distributed.calibrate import describe, measure_comm_costs, measure_layer_costs
from moebal.distributed.expert_parallel import ExpertParallel
from moebal.distributed.groups import ParallelDims
from moebal.distributed.testing import run_ranks
from moebal.models import build_model
from moebal.planner.comm_plan import a2a_chunks, ar_chunk_bytes
from moebal.planner.perf import placement_loads
from moebal.planner.placement import ExpertPlanner
from moebal.scheduler import CommScheduler, step_record

CPU_ONLY = "it emulates devices on shared cores (dilation) and links between network namespaces"
"""Why `--device` accepts cpu only here."""

MODES = ("unscheduled", "lina", "lina+overlap", "serial")


PRESETS: dict[str, dict[str, Any]] = {
    # Lina's byte balance (Table 4.1): an MoE layer in every block with 16 narrow experts, so the rows exchanged
    # dominate the link while the non-expert gradients are a few MB, on a 1 Gbit/s link. Here the unscheduled
    # mode's all-to-alls barely meet a gradient bucket (the buckets of a block are done before the next
    # block's all-to-alls): there is little contention to remove.
    "balanced": {
        "config": {"model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 768,
                             "max_seq_len": 128},
                   "moe": {"num_experts": 16, "top_k": 2, "expert_ffn_dim": 128, "aux_loss_coef": 0.01},
                   "data": {"seq_len": 128, "batch_size": 8}},
        "link_mbit": 1000.0, "bucket_mb": 0.5},
    # The situation the target metric names: DDP-style buckets really in flight while the next MoE block's
    # backward all-to-alls run. GShard's, Switch's and DeepSpeed-MoE's GPT layout (an MoE layer in every other
    # block, dense 4d FFNs between), so a block pair's dense gradients (about 4 MB) are a few times one
    # exchange's rows (1 MB on the wire), as in Lina's GPT-2 and Transformer-XL where a block's fp16 attention
    # and FFN gradients are 10-30 MB; a 300 Mbit/s link, on which one step's gradient sync (10 MB, about
    # 0.27 s) takes about as long as the backward pass computes, so neither the link nor the compute dominates;
    # buckets of one block's mean dense gradients (2.5 MB: DDP's 25 MB is about one block of a large model).
    "contended": {
        "config": {"model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 1024,
                             "max_seq_len": 128},
                   "moe": {"num_experts": 16, "top_k": 2, "expert_ffn_dim": 128, "aux_loss_coef": 0.01,
                           "every": 2},
                   "data": {"seq_len": 128, "batch_size": 8}},
        "link_mbit": 300.0, "bucket_mb": 2.5},
}


def bench_config(preset: str = "balanced") -> Config:
    """The model of a preset (see PRESETS)."""
    base = PRESETS[preset]["config"]
    return from_dict({"name": f"bench-comm-schedule-{preset}", **base,
                      "moe": {**base["moe"]}, "train": {"precision": "fp32"}})


class _System:
    """One mode: its own model copy, scheduler, expert parallelism, planners and optimizer."""

    def __init__(self, mode: str, cfg: Config, dims: ParallelDims, bias: torch.Tensor, dilate: float = 1.0) -> None:
        torch.manual_seed(0)
        self.mode = mode
        self.model = build_model(cfg)
        for layer in self.model.moe_layers():
            layer.expert_bias = bias.clone()
        sched_mode = {"unscheduled": "ddp", "serial": "off"}.get(mode, "lina")
        self.sched = CommScheduler(sched_mode, rank=dims.rank, timeout_s=600, dilate=dilate)
        self.ep = ExpertParallel(self.model, dims, self.sched, overlap=mode == "lina+overlap")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.planners: list[ExpertPlanner] = []
        self.placements: list[Any] = []
        self.chunks = [1] * len(self.ep.dispatchers)

    def plan_setup(self, costs: Any, E: int, R: int) -> None:
        extra = {"overlap": True} if self.mode == "lina+overlap" else {}
        self.planners = [ExpertPlanner(E, R, "prophet", costs, hysteresis=0.05, **extra) for _ in self.ep.dispatchers]
        self.placements = [p.current for p in self.planners]


def _counts(system: _System, dims: ParallelDims) -> list[np.ndarray]:
    out = []
    for layer in system.model.moe_layers():
        local = layer.take_stats().counts_E
        gathered = [torch.zeros_like(local) for _ in range(dims.size("ep"))]
        dist.all_gather(gathered, local, group=dims.group("ep"))
        out.append(torch.stack(gathered).numpy().astype(np.float64))
    return out


def _step(s: _System, ids: torch.Tensor, step: int) -> tuple[float, float, Any]:
    s.sched.log.begin(step)
    for d, c in zip(s.ep.dispatchers, s.chunks):
        d.a2a_chunks = c
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    s.sched.start_compute()
    s.ep.apply(s.placements)
    out = s.model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    s.ep.aggregate()
    s.ep.sync_gradients()
    s.opt.step()
    s.opt.zero_grad(set_to_none=True)
    s.ep.release()
    s.sched.settle()  # the optimizer step on the emulated device (--dilate)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dt, cpu, s.sched.log.end()


def _worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    cfg = from_dict(spec["config"])
    dims = ParallelDims(world_size=world, rank=rank, ep=spec["ep"]).init(timeout_s=600)
    E, R = cfg.moe.num_experts, dims.size("ep")
    bias = -spec["skew"] * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    modes = tuple(spec.get("modes", MODES))
    systems = {m: _System(m, cfg, dims, bias, spec.get("dilate", 1.0)) for m in modes}
    B, T = cfg.data.batch_size, cfg.data.seq_len
    rows = B * T * cfg.moe.top_k
    first = systems["lina"].ep.dispatchers[0]
    dilate = spec.get("dilate", 1.0)
    layer_costs = measure_layer_costs(first, rows, dilate=dilate)
    comm = measure_comm_costs(first, dims.group("dp_ep"), rows, layer_costs, dilate=dilate)
    token_bytes = cfg.model.dim * 4
    for s in systems.values():
        s.plan_setup(layer_costs, E, R)
        total = s.ep.grads.reduced_bytes
        a2a_s = rows * token_bytes * (R - 1) / R / comm.a2a_bandwidth  # one exchange, balanced routing
        s.ep.set_chunk_bytes(spec["bucket_mb"] * 1e6 if s.mode == "unscheduled"
                             else ar_chunk_bytes(comm, total_bytes=total, a2a_s=a2a_s))
    from moebal.launch.netns import mark_started

    mark_started(spec, rank)  # start-up (process groups, channels, measurements) done: see run_world
    n = dims.size("dp_ep")
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    load = [os.getloadavg()[0]]
    traces: dict[str, list[Any]] = {}
    schedule = [(m, False, -1 - w) for m in modes for w in range(spec["warmup"])]
    for k in range(spec["rounds"] * spec["steps"]):  # one step of every mode per round, order rotated
        schedule += [(m, True, k) for m in modes[k % len(modes):] + modes[:k % len(modes)]]
    for step_no, (mode, measured, k) in enumerate(schedule, 1):
        s = systems[mode]
        gen = torch.Generator().manual_seed(1000 * (k + 10) + rank)  # round k: the same batch for every mode
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
        dt, cpu, c = _step(s, ids, step_no)
        counts = _counts(s, dims)
        s.placements = [p.step(x) for p, x in zip(s.planners, counts)]
        if mode.startswith("lina"):
            s.chunks = [a2a_chunks(comm, float(placement_loads(x, p)[1].max()) * token_bytes,
                                   float(placement_loads(x, p)[0].max()))[0]
                        for x, p in zip(counts, s.placements)]
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        v = torch.tensor([c.exposed_s, c.a2a_s, c.allreduce_s, c.placement_s, cpu, c.a2a_shared_s, c.held_s],
                         dtype=torch.float64)
        dist.all_reduce(v)
        v /= n
        if measured and k == spec["rounds"] * spec["steps"] - 1:  # the last round: keep a trace of every rank
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, step_record(c, rank))
            traces[mode] = gathered
        if measured:
            samples[mode].append({"step_s": t.item(), "exposed_s": v[0].item(), "a2a_s": v[1].item(),
                                  "allreduce_s": v[2].item(), "placement_s": v[3].item(), "cpu_s": v[4].item(),
                                  "a2a_shared_s": v[5].item(), "held_s": v[6].item(),
                                  "a2a_chunks": list(s.chunks),
                                  "replicas": sum(p.num_replicas for p in s.placements),
                                  "chunks": s.ep.grads.num_chunks})
    load.append(os.getloadavg()[0])
    for s in systems.values():
        s.ep.close()
        s.sched.close()
    dist.barrier()
    if rank:
        return []
    meta = {"comm_costs": comm.to_dict(), "layer_costs": describe(layer_costs), "load_average": load,
            "ep": R, "dp": dims.size("dp")}
    return [{**_record(m, world, samples[m], meta, systems[m]), "trace": traces.get(m)} for m in modes]


def _record(mode: str, world: int, xs: list[dict[str, Any]], meta: dict[str, Any], s: _System) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(x[key] for x in xs)

    return {"kind": "measured", "mode": mode, "world_size": world, "steps": len(xs),
            "a2a_time_s": med("a2a_s"), "exposed_comm_s": med("exposed_s"), "step_time_median_s": med("step_s"),
            "step_time_min_s": min(x["step_s"] for x in xs), "allreduce_time_s": med("allreduce_s"),
            "placement_comm_s": med("placement_s"), "cpu_s_per_rank": med("cpu_s"),
            "a2a_shared_s": med("a2a_shared_s"), "held_s": med("held_s"),
            "gradient_chunks": xs[-1]["chunks"], "a2a_chunks_last": xs[-1]["a2a_chunks"],
            "replicas_per_step": statistics.mean(x["replicas"] for x in xs),
            # every step, in order: the medians above can be re-derived from them
            "per_step": [{k: x[k] for k in ("step_s", "a2a_s", "exposed_s", "allreduce_s", "placement_s", "held_s")}
                         for x in xs], **meta}


def summarise(records: list[dict[str, Any]]) -> list[str]:
    lines = []
    measured = [r for r in records if r.get("kind") == "measured"]
    for world in sorted({r["world_size"] for r in measured}):
        by = {r["mode"]: r for r in measured if r["world_size"] == world}
        base = by["unscheduled"]
        for m in (m for m in MODES if m in by):
            r = by[m]
            lines.append(f"{world} ranks {m:<13} step {r['step_time_median_s']:.4f}s  a2a {r['a2a_time_s']:.4f}s  "
                         f"exposed {r['exposed_comm_s']:.4f}s  all-reduce {r['allreduce_time_s']:.4f}s  "
                         f"a2a||ar {r['a2a_shared_s']:.4f}s  held {r.get('held_s', float('nan')):.4f}s  "
                         f"a2a x{base['a2a_time_s'] / r['a2a_time_s']:.2f}  "
                         f"step x{base['step_time_median_s'] / r['step_time_median_s']:.2f}")
    for r in records:
        if r.get("kind") == "simulated":
            lines.append(f"simulated {r['experts']:>2} experts on {r['gpus']} A100: {r['mode']:<22} "
                         f"{r['simulated_speedup']:.2f}x (paper {r['paper_speedup']:.2f}x)")
    return lines


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if r.get("kind") == "measured"]
    sim = [r for r in records if r.get("kind") == "simulated" and r["mode"] == "lina"]
    worlds = sorted({r["world_size"] for r in measured})
    fig, axes = plt.subplots(1, 3 + bool(sim), figsize=(4.2 * (3 + bool(sim)), 3.8))
    modes = [m for m in MODES if any(r["mode"] == m for r in measured)]
    width = 0.8 / len(modes)
    for ax, key, title in zip(axes, ("step_time_median_s", "a2a_time_s", "exposed_comm_s"),
                              ("step time", "all-to-all time", "exposed communication")):
        for i, m in enumerate(modes):
            vals = [next(r[key] for r in measured if r["world_size"] == w and r["mode"] == m) for w in worlds]
            ax.bar(np.arange(len(worlds)) + i * width, vals, width, label=m)
        ax.set_xticks(np.arange(len(worlds)) + width, [f"{w} ranks" for w in worlds])
        ax.set_title(f"{title} (median, s)")
    axes[0].legend(fontsize=8)
    if sim:
        ax = axes[-1]
        x = np.arange(len(sim))
        ax.bar(x - 0.2, [r["paper_speedup"] for r in sim], 0.4, alpha=0.5, label="paper")
        ax.bar(x + 0.2, [r["simulated_speedup"] for r in sim], 0.4, label="simulated")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, [f"{r['experts']} experts" for r in sim])
        ax.set_title("Lina on A100 + 100 Gb/s IB: step speedup")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


STARTUP_ATTEMPTS = 3


def run_world(world: int, spec: dict[str, Any], link_mbit: float) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The records of one world size, the network used (a shaped namespace link, or loopback), and the
    start-up failures that were retried (`moebal.launch.netns.run_shaped`)."""
    from moebal.launch.netns import run_shaped, unavailable

    why = unavailable() if link_mbit > 0 else "loopback requested"
    if why is not None:
        return run_ranks(_worker, world, spec, timeout_s=3600)[0], f"loopback ({why})", []
    recs, retried = run_shaped(__file__, world, spec, link_mbit, tag=f"cs{os.getpid()}", subnet=93, port=29571,
                               attempts=STARTUP_ATTEMPTS)
    return recs, f"{link_mbit:g} Mbit/s veth between two network namespaces", retried


def simulated() -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import reproduce_lina

    return reproduce_lina.comparison()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("--png", type=Path, help="write the figure here (default: next to --json)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulated comparison on Lina's cluster")
    ap.add_argument("--worlds", default="2,4", help="rank counts to run (default 2,4)")
    ap.add_argument("--skew", type=float, default=2.0, help="strength s of the routing skew -s*log(id+1)")
    ap.add_argument("--preset", default="contended", choices=sorted(PRESETS),
                    help="model, link rate and bucket size (see PRESETS; default contended)")
    ap.add_argument("--bucket-mb", type=float, help="bucket size of the unscheduled mode (default: the preset's)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes to run (default {','.join(MODES)})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a model config key of the preset (e.g. model.dim=512); repeatable")
    ap.add_argument("--link-mbit", type=float,
                    help="rate of the link between the two namespace nodes (0: loopback, no namespaces)")
    ap.add_argument("--dilate", type=float, default=1.0,
                    help="emulate devices this many times slower than a core (moebal.distributed.dilate; 1: off); the "
                         "link is slowed by the same factor unless --link-mbit is given")
    ap.add_argument("--trace", type=Path, help="write a Chrome trace of one step of every mode into this folder")
    ap.add_argument("--rank-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    if args.rank_worker:
        from moebal.launch.netns import rank_worker

        return rank_worker(*args.rank_worker, _worker)
    preset = PRESETS[args.preset]
    cfg = bench_config(args.preset)
    if args.set:
        cfg = with_overrides(cfg, args.set)
    args.bucket_mb = preset["bucket_mb"] if args.bucket_mb is None else args.bucket_mb
    if args.dilate < 1:
        ap.error(f"--dilate must be >= 1 (1: off); got {args.dilate}")
    args.link_mbit = preset["link_mbit"] / args.dilate if args.link_mbit is None else args.link_mbit
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "unscheduled" not in modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma list of {', '.join(MODES)} that includes unscheduled (the baseline)")
    spec = {"config": to_dict(cfg), "skew": args.skew, "bucket_mb": args.bucket_mb, "modes": modes,
            "rounds": 8 if args.quick else 20, "steps": 1, "warmup": 2, "dilate": args.dilate}
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    network = {}
    for world in (int(w) for w in args.worlds.split(",")):
        recs, network[world], retried = run_world(world, {**spec, "ep": 2}, args.link_mbit)
        for r in recs:
            r["network"] = network[world]
            r["startup_failures_retried"] = retried
        records += recs
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cores": os.cpu_count(), "threads_per_rank": 1, "config": spec["config"], "skew": args.skew,
            "preset": args.preset, "overrides": args.set, "link_mbit": args.link_mbit, "dilate": args.dilate,
            "bucket_mb": args.bucket_mb, "rounds": spec["rounds"], "steps_per_round": spec["steps"],
            "wall_s": round(time.perf_counter() - t0, 1)}
    for r in records:
        r["meta"] = meta
    if not args.no_sim:
        records += simulated()
    for line in summarise(records):
        print(line)
    if args.trace:
        from moebal.scheduler import write_chrome_trace

        args.trace.mkdir(parents=True, exist_ok=True)
        for r in records:
            if r.get("trace"):
                write_chrome_trace(r["trace"], args.trace / f"{r['world_size']}ranks-{r['mode']}.json")
    for r in records:
        r.pop("trace", None)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1))
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png:
        plot(records, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
