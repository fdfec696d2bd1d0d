"""Lina's inference scheduling against static expert parallelism: MoE layer time (the slowest rank's) on gloo ranks.

The model is a trained run's (its newest checkpoint), served with top-1 routing (Lina's inference setting). Two
changes make it a benchmark of skewed inference on experts of a realistic width, and neither changes what the
trained routers and attention compute:
  - **skew**: every MoE layer gets a selection bias -s log(1 + pi_l(e)) (pi_l: a permutation of the experts drawn
    per layer, so each layer has its own hot experts, as in the thesis's Table 4.2), with s found by bisection so
    that the busiest expert's load is `--skew` (4) times the mean, averaged over the layers, on the profiling
    batches; the figure measured on the benchmark batches is reported beside it;
  - **width**: the experts are padded from the trained width to `--width` hidden units (the new w1/w3 rows
    random, the new w2 columns zero), so each expert computes what a `--width`-wide expert costs while its
    output is the trained expert's (checked: logits within 1e-4 of the unpadded model's).
The path profile is built from the served model's routing on training batches (Lina profiles offline on the
training data); the timed batches come from the validation split.

Per rank count, `--rounds` rounds each run every policy over the same `--batches` batches, the policies in an
order rotated per round; a forward's MoE time is the sum over MoE layers of the slowest rank's time in the layer
(planning, both all-to-alls, the experts; the gate is outside and the same for every policy). Reported: every
round's median per policy, the median over rounds, static / lina, and the same over the layers with a path before
them (1 .. L-1, `*_layers_1_on`; layer 0 is planned from the profile's marginal of layer 0, so every layer is
scheduled, and this figure compares with records made when layer 0 ran static under every policy). Beside them,
what the layer time is made of: the slowest rank's expert compute, planning and time inside the collectives,
waits included (`exchange_s`), per layer (summed over layers 1 .. L-1, per policy); how evenly a layer's work
falls on the ranks, as rows (`rank_load_max_over_mean`, the busiest rank's rows over the mean, every layer) and
as measured expert time (`experts_s_max_over_mean_layers_1_on`, the same of each rank's expert compute, layers
1 .. L-1: above the rows' figure by the per-group cost and by the host's noise in each rank's compute); the two
collectives a layer makes, timed alone on the same ranks (`comm_floor`: the count exchange and two all-to-alls of a
rank's rows), which no placement shrinks; and the expert loop's cost per row by group size, whole groups against
the CPU's blocks (`expert_us_per_row`); and how much a rank's CPU time for the same rows varies on this host,
alone and with every rank computing at once at the emulation's duty cycle (`expert_cpu_spread`: the 10th, 50th and
90th percentiles of the expert loop on a balanced rank's rows), which a balanced placement pays and static's hot
rank, computing alone, does not.

`--dilate 1 3` adds, per rank count, a run on devices emulated 3x slower than a core (moebal/distributed/dilate.py:
every span of compute between meeting points lasts 3x its CPU time, so 4 ranks on 2 cores are not time-sliced
against each other), beside the CPU's own run (factor 1, the default), under `by_ranks_dilated`.

`--width 1024 4096` serves the same model at each width in turn, narrowest first (each padding continues the
last, so the narrower expert is the wider one's first rows), one record per width under `by_width`: the wider
experts' compute weighs more against the collectives, whose bytes do not grow with the width.

Without RUN_DIR the script first trains the served model it documents (`SERVED`, about 100 s on 2 cores) into a
temporary directory. `--quick`: 2 ranks, one round of 2 batches, a model trained for 60 steps, the CPU spread
measured for 0.3 s instead of 6 s (a smoke run).

Usage: python scripts/bench_lina_inference.py [RUN_DIR] [--ranks 2 4] [--dilate 1 3] [--width 1024 4096]
           [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from moebal.commands.bench import at_least
from moebal.commands.eval import ServeJob, load_run_model, pack, serve_worker
from moebal.config import Config
from moebal.data import build_data, eval_batches
from moebal.distributed.dilate import settle
from moebal.distributed.lina_inference import CPU_BLOCK_ROWS, expert_rows
from moebal.distributed.testing import run_ranks
from moebal.kernels.bench import time_fn
from moebal.planner.ffd import devices_from_load, ffd_allocate, split_rows
from moebal.planner.paths import build_profile

POLICIES = ["static", "lina", "phase1", "oracle"]
SERVED = ("model.n_layers=6", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
          "moe.expert_ffn_dim=128", "data.seq_len=64", "data.batch_size=16", "train.steps=300",
          "train.record_routing_every=5", "train.time_limit_min=null")
"""The served model's `moebal train` overrides (the default run otherwise: 2 expert-parallel ranks)."""


def train_served(out: Path, steps: int | None = None) -> Path:
    """Train the served model (`SERVED`, `steps` instead of its 300 when given) into `out`; returns `out`."""
    overrides = [o for o in SERVED if not (steps and o.startswith("train.steps="))]
    overrides += [f"train.steps={steps}"] if steps else []
    cmd = [sys.executable, "-c", "import sys; from moebal.cli import main; sys.exit(main())", "train",
           "--out", str(out), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"training the served model failed ({' '.join(cmd[3:])}):\n{done.stderr[-2000:]}")
    return out


def _pad_experts(model: Any, width: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in model.moe_layers():
        ex = layer.experts
        E, F0, D = ex.w1.shape
        if width <= F0:
            continue
        std = float(ex.w1.detach().std())
        w1, w3 = (torch.cat([w.detach(), torch.randn(E, width - F0, D, generator=g) * std], 1) for w in (ex.w1, ex.w3))
        w2 = torch.cat([ex.w2.detach(), torch.zeros(E, D, width - F0)], 2)
        ex.w1, ex.w3, ex.w2 = (torch.nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))
        layer.ffn_dim = width


def _routing(model: Any, batches: list[torch.Tensor]) -> list[np.ndarray]:
    """[L, T, K] expert ids per batch, single process."""
    out = []
    with torch.no_grad():
        for ids in batches:
            model(ids)
            out.append(np.stack([layer.last_routing.indices_TK.numpy() for layer in model.moe_layers()]))
    return out


def _skew(samples: list[np.ndarray], E: int) -> list[float]:
    """Busiest expert's load / mean load per layer, over the samples."""
    ids = np.concatenate(samples, axis=1)
    return [float(np.bincount(ids[j].reshape(-1), minlength=E).max() / (ids[j].size / E)) for j in range(len(ids))]


def _set_bias(model: Any, s: float, perms: list[np.ndarray]) -> None:
    for layer, perm in zip(model.moe_layers(), perms):
        layer.expert_bias = -s * torch.log1p(torch.as_tensor(perm, dtype=torch.float32))


def _fit_skew(model: Any, batches: list[torch.Tensor], target: float, perms: list[np.ndarray], E: int) -> float:
    lo, hi = 0.0, 8.0
    for _ in range(14):
        mid = (lo + hi) / 2
        _set_bias(model, mid, perms)
        if statistics.mean(_skew(_routing(model, batches), E)) < target:
            lo = mid
        else:
            hi = mid
    _set_bias(model, (lo + hi) / 2, perms)
    return (lo + hi) / 2


def _row_costs(layer: Any, dim: int, sizes: tuple[int, ...] = (64, 128, 256, 512, 1024), repeats: int = 15
               ) -> dict[str, dict[str, float]]:
    """Microseconds per row of one expert's rows through `expert_rows` (one thread, median of `repeats`), by group
    size, in one GEMM per projection (`whole`) and in blocks of CPU_BLOCK_ROWS (`blocks`, the CPU default): what
    a rank's expert time is made of, and whether it is proportional to the rows FFD balances."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, dict[str, float]] = {"whole": {}, "blocks": {}}
    try:
        for n in sizes:
            recv = np.zeros((1, layer.num_experts), dtype=np.int64)
            recv[0, 0] = n
            x = torch.randn(n, dim)
            for name, block in (("whole", 0), ("blocks", CPU_BLOCK_ROWS)):
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        expert_rows(layer.experts, x, recv, block)
                    times.append(time.perf_counter() - t0)
                out[name][str(n)] = statistics.median(times) / n * 1e6
    finally:
        torch.set_num_threads(threads)
    return out


def _spread_worker(rank: int, world: int, shape: tuple[int, int, int], rows: int, dilate: float, seconds: float
                   ) -> dict[str, float]:
    """CPU-time percentiles (ms) of the expert loop on `rows` rows of two experts ([E, D, F] `shape`, random
    weights), repeated for `seconds` at an emulated device's duty cycle (each run followed by a sleep to `dilate`
    x its CPU time, as DeviceClock does), on this rank while the other ranks do the same."""
    torch.set_num_threads(1)
    E, D, Fw = shape
    g = torch.Generator().manual_seed(rank)
    ex = SimpleNamespace(w1=torch.randn(E, Fw, D, generator=g), w3=torch.randn(E, Fw, D, generator=g),
                         w2=torch.randn(E, D, Fw, generator=g))
    recv = np.zeros((1, E), dtype=np.int64)
    recv[0, :2] = rows - rows // 5, rows // 5  # a balanced rank's share: most of one expert, part of another
    x = torch.randn(rows, D, generator=g)
    cpu: list[float] = []
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            t0, c0 = time.perf_counter(), time.thread_time()
            expert_rows(ex, x, recv, CPU_BLOCK_ROWS)
            cpu.append(time.thread_time() - c0)
            settle(dilate, cpu[-1], t0)
    p10, p50, p90 = np.percentile(np.array(cpu) * 1e3, [10, 50, 90])
    return {"p10_ms": float(p10), "p50_ms": float(p50), "p90_ms": float(p90), "runs": float(len(cpu))}


def _percentiles(pct: dict[str, float]) -> str:
    """"p10/p50/p90" of one `_spread_worker` result, in ms."""
    return "/".join(f"{pct[k]:.2f}" for k in ("p10_ms", "p50_ms", "p90_ms"))


def _cpu_spread(shape: tuple[int, int, int], rows: int, ranks: list[int], dilate: float, seconds: float = 6.0
                ) -> dict[str, Any]:
    """How much a rank's expert time varies for the same rows on this host: `_spread_worker` on one rank alone,
    then on each rank count at once (every rank's percentiles). A layer waits for the slowest rank, so under a
    balanced placement this spread, not the rows, sets the layer's expert time; a device's kernels vary far less."""
    out: dict[str, Any] = {"rows": rows, "dilate": dilate,
                           "alone": run_ranks(_spread_worker, 1, shape, rows, dilate, seconds)[0]}
    for R in ranks:
        out[f"{R}_at_once"] = run_ranks(_spread_worker, R, shape, rows, dilate, seconds, timeout_s=600)
    return out


def _planning_costs(profile: Any, sample: np.ndarray, ranks: list[int], tokens: int, repeats: int = 50
                    ) -> dict[str, float]:
    """Milliseconds (median of `repeats`, one thread) of the planning steps of the last MoE layer on `tokens` of
    one routing sample ([L, T, K]): the path estimate, and FFD plus the row split per rank count."""
    L = sample.shape[0]
    paths_TL = np.ascontiguousarray(sample[:L - 1, :tokens, 0].T)
    est_E = profile.estimate(paths_TL, L - 1)
    counts_E = np.bincount(sample[L - 1, :tokens].reshape(-1), minlength=len(est_E))

    def plan(R: int) -> None:  # every rank with this sample's counts
        split_rows(np.tile(counts_E, (R, 1)), ffd_allocate(devices_from_load(est_E.tolist(), R, est_E.sum()), R))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"estimate_ms": 1e3 * time_fn(lambda: profile.estimate(paths_TL, L - 1), repeats=repeats).median,
               "tokens": float(paths_TL.shape[0])}
        for R in ranks:
            out[f"ffd_and_split_{R}_ranks_ms"] = 1e3 * time_fn(lambda R=R: plan(R), repeats=repeats).median
    finally:
        torch.set_num_threads(threads)
    return out


def _floor_worker(rank: int, world: int, fields: int, rows: int, dim: int, reps: int) -> dict[str, float]:
    """Median seconds of the two collectives an MoE layer makes under every policy, with nothing else to wait for:
    the count exchange of `fields` doubles per rank (counts, estimate, tokens: one all-to-all of the row
    repeated, as the dispatcher makes it) and an all-to-all of `rows` rows of `dim` fp32 values per rank in equal
    splits (each layer makes two). Beside them, the same count exchange as gloo's all-gather (`all_gather_s`),
    the primitive the dispatcher does not use (docs/expert-parallel.md)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    mine = torch.zeros(fields, dtype=torch.float64)
    every, every_list = torch.empty(world, fields, dtype=torch.float64), [torch.empty_like(mine) for _ in range(world)]
    x, out = torch.randn(rows, dim), torch.empty(rows, dim)
    times: dict[str, list[float]] = {"counts_s": [], "all_to_all_s": [], "all_gather_s": []}
    for i in range(reps + 5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(every, mine.repeat(world))
        t1 = time.perf_counter()
        dist.all_to_all_single(out, x)
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_gather(every_list, mine)
        t4 = time.perf_counter()
        if i >= 5:
            times["counts_s"].append(t1 - t0)
            times["all_to_all_s"].append(t2 - t1)
            times["all_gather_s"].append(t4 - t3)
    return {k: statistics.median(v) for k, v in times.items()}


def _max_over_mean(per_rank: list[float]) -> float:
    """The busiest rank's figure over the ranks' mean (1: even)."""
    return max(per_rank) / max(statistics.mean(per_rank), 1e-12)


def _summary(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    L = len(results[0]["rounds"][0]["static"]["forwards"][0])

    def per_round(p: str, key: str, first: int) -> list[float]:
        """Per round: the median over forwards of the sum over layers first .. L-1 of the slowest rank's `key`."""
        medians = []
        for rnd in range(rounds):
            fw = [r["rounds"][rnd][p]["forwards"] for r in results]
            medians.append(statistics.median(sum(max(rank[f][j][key] for rank in fw) for j in range(first, L))
                                             for f in range(len(fw[0]))))
        return medians

    for p in POLICIES:
        moe_all, moe_sched = per_round(p, "seconds", 0), per_round(p, "seconds", 1)
        experts, plan = per_round(p, "experts_s", 1), per_round(p, "plan_s", 1)
        exchange = per_round(p, "exchange_s", 1)
        f0 = results[0]["rounds"][0][p]["forwards"]
        loads = [[_max_over_mean(rec["rank_rows"]) for rec in fwd] for fwd in f0]
        hits = [rec["estimate_hit"] for fwd in f0 for rec in fwd if rec["estimate_hit"] is not None]
        spread = [_max_over_mean([r["rounds"][rnd][p]["forwards"][f][j]["experts_s"] for r in results])
                  for rnd in range(rounds) for f in range(len(f0)) for j in range(1, L)]
        out[p] = {"moe_s_rounds": moe_all, "moe_s": statistics.median(moe_all),
                  "moe_s_layers_1_on_rounds": moe_sched, "moe_s_layers_1_on": statistics.median(moe_sched),
                  "experts_s_layers_1_on_rounds": experts, "experts_s_layers_1_on": statistics.median(experts),
                  "plan_s_layers_1_on": statistics.median(plan),
                  "exchange_s_layers_1_on": statistics.median(exchange),
                  "rank_load_max_over_mean": statistics.mean(x for fwd in loads for x in fwd),
                  "experts_s_max_over_mean_layers_1_on": statistics.mean(spread),
                  "replans_per_forward": statistics.mean(sum(rec["replanned"] for rec in fwd) for fwd in f0),
                  "estimate_top2k_equal": statistics.mean(hits) if hits else None,
                  "equal_static": all(r["rounds"][i][p]["equal_static"] is not False
                                      for r in results for i in range(rounds))}
    for p in POLICIES[1:]:
        out[f"static_over_{p}"] = out["static"]["moe_s"] / out[p]["moe_s"]
        out[f"static_over_{p}_layers_1_on"] = out["static"]["moe_s_layers_1_on"] / out[p]["moe_s_layers_1_on"]
        out[f"static_over_{p}_experts_layers_1_on"] = (out["static"]["experts_s_layers_1_on"]
                                                        / out[p]["experts_s_layers_1_on"])
    return out


def _run_width(model: Any, cfg: Any, data: Any, args: argparse.Namespace, profile: Any) -> dict[str, Any]:
    """Every (rank count, dilation) run of the model at its current width: `by_ranks` and `by_ranks_dilated`."""
    E = cfg.moe.num_experts
    out: dict[str, Any] = {"by_ranks": {}}
    for R, dilate in ((R, d) for R in args.ranks for d in args.dilate):
        val = eval_batches(data.corpus.val, cfg.data.samples, cfg.data.seq_len, R * args.rows, args.batches)
        batches = [b.ids_BT for b in val if b.ids_BT.shape[0] == R * args.rows][:args.batches]
        order = [POLICIES[i % 4:] + POLICIES[:i % 4] for i in range(args.rounds)]
        job = ServeJob(model=model, batches=batches, policies=order, profile=profile, dilate=dilate)
        results = run_ranks(serve_worker, R, pack(job), timeout_s=3600)
        summ = _summary(results, args.rounds)
        tokens = args.rows * batches[0].shape[1]
        floor = run_ranks(_floor_worker, R, 2 * E + 1, tokens, cfg.model.dim, 100, timeout_s=600)
        summ["comm_floor"] = {k: max(f[k] for f in floor) for k in floor[0]}
        summ["comm_floor"]["per_layer_s"] = summ["comm_floor"]["counts_s"] + 2 * summ["comm_floor"]["all_to_all_s"]
        summ["skew_timed_batches"] = _skew(_routing(model, batches), E)
        summ["policy_order_per_round"] = order
        if dilate == 1.0:
            out["by_ranks"][str(R)] = summ
        else:  # emulated devices: beside the CPU's own figure, never instead of it
            out.setdefault("by_ranks_dilated", {}).setdefault(f"{dilate:g}", {})[str(R)] = summ
        where = "" if dilate == 1.0 else f" (devices {dilate:g}x slower than a core)"
        print(f"width {model_width(model)}, {R} ranks{where}: static {summ['static']['moe_s'] * 1e3:.1f} ms, "
              f"lina {summ['lina']['moe_s'] * 1e3:.1f} ms, "
              f"phase1 {summ['phase1']['moe_s'] * 1e3:.1f} ms, oracle {summ['oracle']['moe_s'] * 1e3:.1f} ms; "
              f"static/lina {summ['static_over_lina']:.2f} "
              f"(layers 1..L-1: {summ['static_over_lina_layers_1_on']:.2f}); "
              f"skew {statistics.mean(summ['skew_timed_batches']):.2f}; outputs equal static: "
              f"{all(summ[p]['equal_static'] for p in POLICIES)}; layers 1..L-1: experts (slowest rank) static "
              f"{summ['static']['experts_s_layers_1_on'] * 1e3:.1f} ms, lina "
              f"{summ['lina']['experts_s_layers_1_on'] * 1e3:.1f} ms "
              f"({summ['static_over_lina_experts_layers_1_on']:.2f}x); a layer's rows max/mean over the ranks: "
              f"static {summ['static']['rank_load_max_over_mean']:.2f}, "
              f"lina {summ['lina']['rank_load_max_over_mean']:.2f}"
              f"; its expert time max/mean: static {summ['static']['experts_s_max_over_mean_layers_1_on']:.2f}, lina "
              f"{summ['lina']['experts_s_max_over_mean_layers_1_on']:.2f}; planning (slowest rank) static "
              f"{summ['static']['plan_s_layers_1_on'] * 1e3:.1f} ms, "
              f"lina {summ['lina']['plan_s_layers_1_on'] * 1e3:.1f} ms; in the collectives (slowest rank, waits "
              f"included) static {summ['static']['exchange_s_layers_1_on'] * 1e3:.1f} ms, "
              f"lina {summ['lina']['exchange_s_layers_1_on'] * 1e3:.1f} ms; "
              f"collectives alone "
              f"{summ['comm_floor']['per_layer_s'] * 1e3:.2f} ms per layer", flush=True)
    return out


def _check_width(width: int, trained: int) -> None:
    if width < trained:
        raise SystemExit(f"--width {width} is below the served experts' trained width {trained}: give widths of at "
                         f"least {trained}")


def model_width(model: Any) -> int:
    """The experts' hidden width (after padding)."""
    return int(next(iter(model.moe_layers())).experts.w1.shape[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", help="a `moebal train` run to serve (default: train `SERVED` first)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 2 4; quick: 2)")
    ap.add_argument("--skew", type=float, default=4.0, help="busiest expert / mean load to fit (0: the model's own)")
    ap.add_argument("--width", type=int, nargs="+", default=[1024],
                    help="expert hidden widths after padding, each a run of its own (narrowest first)")
    ap.add_argument("--rows", type=int, default=8, help="sequences per rank per forward")
    ap.add_argument("--batches", type=int, default=None, help="timed forwards per policy per round (default 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, policies rotated (default 3; quick: 1)")
    ap.add_argument("--profile-batches", type=int, default=16, help="training batches the path profile is built on")
    ap.add_argument("--path-len", type=at_least(1), default=3)
    ap.add_argument("--dilate", type=float, nargs="+", default=[1.0],
                    help="emulated devices this many times slower than a core, one run per factor beside each other "
                         "(1: the CPU as it is, the default; moebal/distributed/dilate.py)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 ranks, 1 round of 2 batches, 60 steps")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="steps of the served model's training without RUN_DIR (default 300; quick: 60)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    defaults = {"ranks": [2], "batches": 2, "rounds": 1} if args.quick else {"ranks": [2, 4], "batches": 4, "rounds": 3}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.width = sorted(set(args.width))
    for name in ("ranks", "width", "dilate", "batches", "rounds", "train_steps", "profile_batches"):
        v = getattr(args, name)
        if v is not None and min(v if isinstance(v, list) else [v]) <= 0:
            ap.error(f"--{name.replace('_', '-')} takes positive values; got {v}")
    if not args.run_dir:  # before training: the served model's width is known
        _check_width(args.width[0], int(dict(o.split("=") for o in SERVED)["moe.expert_ffn_dim"]))
    return serve_and_record(args, _measure)


def serve_and_record(args: argparse.Namespace, measure: Callable[[argparse.Namespace, Path], dict[str, Any]]) -> int:
    """`measure(args, run_dir)` on `args.run_dir`, or on the served model trained first into a temporary directory
    (`SERVED`; `args.train_steps` steps, 60 with `args.quick`); its record, with the served model and the wall
    time, written to `args.json` (this benchmark's and scripts/bench_lina_decode.py's)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lina-served-") as tmp:
        steps = args.train_steps or (60 if args.quick else None)
        run_dir = Path(args.run_dir) if args.run_dir else train_served(Path(tmp) / "run", steps)
        res = measure(args, run_dir)
    # a given run is named by its folder's name only: a record does not carry the machine's paths
    res["served_model"] = (f"RUN_DIR ({Path(args.run_dir).name}, given on the command line)" if args.run_dir else
                           "moebal train " + " ".join(SERVED) + (f" (train.steps={steps})" if steps else ""))
    res["wall_s"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


@dataclass
class Skewed:
    """The served model of a run under top-1, its MoE layers skewed (`skewed_model`)."""

    cfg: Config
    model: Any
    data: Any  # `build_data(cfg, seed=1234)`: the profile's training batches, the validation split's sequences
    prof_batches: list[torch.Tensor]  # the training batches the path profile is built on, the skew fitted on 4
    bias_strength: float  # s of the selection bias (0.0: the model's own routing)
    logits: torch.Tensor  # the skewed model's logits on `prof_batches[0][:2]`, before any padding

    def pad(self, width: int) -> float:
        """Pad the experts to `width` (`_pad_experts`, the trained function kept); the largest change of the
        logits on the reference rows, which must stay under 1e-4."""
        with torch.no_grad():
            _pad_experts(self.model, width)
            diff = float((self.logits - self.model(self.prof_batches[0][:2]).logits).abs().max())
        assert diff < 1e-4, f"padding to {width} changed the logits by {diff}"
        return diff


def skewed_model(run_dir: Path, skew: float, profile_batches: int) -> Skewed:
    """The served model of `run_dir` under top-1, each MoE layer skewed to its own hot experts (`_fit_skew`: the
    busiest expert `skew` x the mean load; 0: the model's own routing), as this benchmark and
    scripts/bench_lina_decode.py serve it."""
    cfg, model, _ = load_run_model(run_dir, top_k=1)
    E = cfg.moe.num_experts
    data = build_data(cfg, seed=1234)
    prof_batches = [data.train.next_batch().ids_BT for _ in range(profile_batches)]
    rng = np.random.default_rng(0)
    perms = [rng.permutation(E) for _ in model.moe_layers()]
    s = _fit_skew(model, prof_batches[:4], skew, perms, E) if skew > 0 else 0.0
    with torch.no_grad():
        logits = model(prof_batches[0][:2]).logits
    return Skewed(cfg, model, data, prof_batches, s, logits)


def _measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The whole benchmark on the served model of `run_dir` (module docstring)."""
    served = skewed_model(run_dir, args.skew, args.profile_batches)
    cfg, model, data, prof_batches, s = served.cfg, served.model, served.data, served.prof_batches, served.bias_strength
    E = cfg.moe.num_experts
    res: dict[str, Any] = {
        "machine": f"{platform.machine()}, torch {torch.__version__}, gloo",
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")},
        "bias_strength": s, "num_experts": E, "moe_layers": sum(1 for _ in model.moe_layers()), "top_k": 1,
        "by_width": {}}
    _check_width(args.width[0], model_width(model))
    for width in args.width:
        pad_diff = served.pad(width)
        prof_routing = _routing(model, prof_batches)
        profile = build_profile(prof_routing, E, args.path_len)
        if "planning_ms" not in res:
            res["planning_ms"] = _planning_costs(profile, prof_routing[0], args.ranks, args.rows * cfg.data.seq_len)
            print("planning alone (ms, one thread, last layer): " + ", ".join(
                f"{k[:-3]} {v:.3f}" for k, v in res["planning_ms"].items() if k.endswith("_ms")))
        layer = next(iter(model.moe_layers()))
        row_costs = _row_costs(layer, cfg.model.dim)
        print(f"width {width}: expert cost per row (us, one thread), by group size: " + "; ".join(
            f"{name} " + ", ".join(f"{n}: {v:.1f}" for n, v in costs.items()) for name, costs in row_costs.items()))
        spread = _cpu_spread(tuple(layer.experts.w1.shape[i] for i in (0, 2, 1)), args.rows * cfg.data.seq_len,
                             args.ranks, max(args.dilate), 0.3 if args.quick else 6.0)
        print(f"width {width}: expert loop CPU time on {spread['rows']} rows (ms, p10/p50/p90), at a duty cycle of "
              f"1/{spread['dilate']:g}: alone {_percentiles(spread['alone'])}"
              + "".join(f"; {R} ranks at once " + ", ".join(map(_percentiles, spread[f"{R}_at_once"]))
                        for R in args.ranks))
        res["by_width"][str(width)] = {"padding_max_logit_diff": pad_diff, "expert_us_per_row": row_costs,
                                       "expert_cpu_spread": spread, **_run_width(model, cfg, data, args, profile)}
    return res


if __name__ == "__main__":
    sys.exit(main())
