"""Validate the simulator: predicted vs measured step time of real moebal runs on this machine.

    python scripts/validate_simulator.py [--json FILE] [--png FILE] [--rounds 7]

The machine is shared, so the calibration runs inside the validation: `moebal calibrate`'s probes (GEMMs by
shape and layout, elementwise kernels, SDPA, gloo collectives at 64 KB / 1 MB / 8 MB per rank) run round-robin
with the workloads, every figure is a median over the rounds, and both sides see the same background load.
The profile is then fitted from the probes alone and predicts the workloads, which it never saw: whole
training steps of moebal models (forward, backward, AdamW) in one process, expert-parallel steps on 2 gloo
ranks (static and replicated placements, moebal's own Trans/Agg; compute probes timed with both ranks busy),
and gloo collectives with uneven splits and sizes the probes did not use. MoE predictions replay the routing
counts the measured run produced. The records carry `config`, `measured_s` and `predicted_s`; pipeline runs
join as records once the pipeline engine can be timed the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.bench import add_device_argument, script_device

CPU_ONLY = "it validates the simulator against runs on this machine's cores (gloo ranks)"
"""Why `--device` accepts cpu only here."""

MODEL_CASES: list[dict[str, Any]] = [
    {"name": "dense d256 L4 b4x256", "model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                              "ffn_dim": 768}, "moe": {"num_experts": 0}, "batch": 4, "seq": 256},
    {"name": "dense d512 L2 b2x512", "model": {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8,
                                              "ffn_dim": 1536}, "moe": {"num_experts": 0}, "batch": 2, "seq": 512},
    {"name": "moe d256 L4 E8 k2 b4x256", "model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                                  "ffn_dim": 768},
     "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 512}, "batch": 4, "seq": 256},
    {"name": "moe d384 L2 E4 k1 b8x128", "model": {"dim": 384, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6,
                                                  "ffn_dim": 1024},
     "moe": {"num_experts": 4, "top_k": 1, "expert_ffn_dim": 1024}, "batch": 8, "seq": 128},
    {"name": "moe d128 L6 E16 k2 b8x128", "model": {"dim": 128, "n_layers": 6, "n_heads": 4, "n_kv_heads": 4,
                                                   "ffn_dim": 384},
     "moe": {"num_experts": 16, "top_k": 2, "expert_ffn_dim": 256}, "batch": 8, "seq": 128},
]

EP_CASES: list[dict[str, Any]] = [
    {"name": "ep2 static d256 L2 E4 k2 b4x256", "placement": "static",
     "model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 768},
     "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 512}, "batch": 4, "seq": 256},
    {"name": "ep2 replicated d256 L2 E4 k2 b4x256", "placement": "replicate_hot",
     "model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 768},
     "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 512}, "batch": 4, "seq": 256},
    {"name": "ep2 static d384 L2 E8 k2 b2x512", "placement": "static",
     "model": {"dim": 384, "n_layers": 2, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 1024},
     "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 768}, "batch": 2, "seq": 512},
]

PIPE_CASES: list[dict[str, Any]] = [
    {"name": "pp2 1f1b dense d256 L4 m4 b8x128", "schedule": "1f1b", "micro_batches": 4,
     "model": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 768}, "moe": {"num_experts": 0},
     "batch": 8, "seq": 128},
    {"name": "pp2 gpipe dense d384 L6 m2 b4x256", "schedule": "gpipe", "micro_batches": 2,
     "model": {"dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 6, "ffn_dim": 1024},
     "moe": {"num_experts": 0}, "batch": 4, "seq": 256},
]

CAL_SIZES = [65536, 262144, 1048576, 4194304, 16777216]

STATS = {"median": statistics.median, "min": min}
"""The figure of a probe or workload over its rounds: the median (primary), and the minimum (secondary: other
jobs on a shared machine only ever add time, so the minimum is the least disturbed sample)."""
"""Collective calibration payloads (bytes per rank); the validation collectives use other sizes and splits."""

COLL_CASES: list[dict[str, Any]] = [
    {"name": "all_to_all uneven 2 ranks 3 MB", "kind": "all_to_all", "world": 2, "split_mb": [[0.5, 2.5], [1.5, 0.3]]},
    {"name": "all_to_all uneven 3 ranks", "kind": "all_to_all", "world": 3,
     "split_mb": [[0.2, 1.6, 0.4], [0.8, 0.1, 2.0], [0.3, 0.9, 0.5]]},
    {"name": "all_to_all uneven 4 ranks", "kind": "all_to_all", "world": 4,
     "split_mb": [[0.1, 1.2, 0.3, 0.6], [0.4, 0.2, 0.2, 1.0], [0.9, 0.3, 0.1, 0.2], [0.2, 0.8, 0.5, 0.1]]},
    {"name": "all_reduce 3 ranks 3 MB", "kind": "all_reduce", "world": 3, "mb": 3.0},
    {"name": "broadcast 4 ranks 4 MB", "kind": "broadcast", "world": 4, "mb": 4.0},
    {"name": "send/recv 2 MB", "kind": "p2p", "world": 2, "mb": 2.0},
]


def _cfg(case: dict[str, Any], pp: int = 1) -> Any:
    from moebal.config import from_dict

    model = {**case["model"], "vocab_size": 256, "max_seq_len": case["seq"]}
    return from_dict({"model": model, "moe": {"aux_loss_coef": 0.01, **case["moe"]},
                      "data": {"seq_len": case["seq"], "batch_size": case["batch"], "max_bytes": 2_000_000},
                      "train": {"precision": "fp32", "warmup_steps": 0, "eval_every": 0},
                      "parallel": {"pp": pp, "nproc": pp}})


# ---- workloads (each a callable running one training step or one collective) ------------------------------
def model_step(case: dict[str, Any]) -> tuple[Any, Any]:
    """(one forward + backward + AdamW step of a single-process moebal model, the model)."""
    import torch

    from moebal.models import build_model

    torch.manual_seed(0)
    cfg = _cfg(case)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (case["batch"], case["seq"] + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def ep_step(case: dict[str, Any], rank: int, world: int) -> tuple[Any, Any]:
    """(one expert-parallel step on this rank: Trans, forward, backward, Agg, gradient sync, AdamW; the model)."""
    import torch

    from moebal.distributed.expert_parallel import ExpertParallel
    from moebal.distributed.groups import ParallelDims
    from moebal.models import build_model

    cfg = _cfg(case)
    torch.manual_seed(0)
    model = build_model(cfg)
    ep = ExpertParallel(model, ParallelDims(world_size=world, rank=rank, ep=world).init())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    placements = _placements(case["placement"], cfg.moe.num_experts, world, sum(1 for _ in model.moe_layers()))
    ids = torch.randint(0, 256, (case["batch"], case["seq"] + 1), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        ep.apply(placements)
        out = model(ids[:, :-1], ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        ep.aggregate()
        ep.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def _placements(kind: str, E: int, R: int, layers: int) -> list[Any]:
    from moebal.planner.plan import ExpertPlacement, default_owners

    owner = default_owners(E, R)
    if kind == "static":
        return [ExpertPlacement.static(E, R) for _ in range(layers)]
    # replicate the first expert of every rank on every other rank (a fixed, replayable placement)
    per = E // R
    reps = tuple(tuple(r for r in range(R) if r != owner[e]) if e % per == 0 else () for e in range(E))
    return [ExpertPlacement(num_ranks=R, owner=owner, replicas=reps, policy="replicate") for _ in range(layers)]


def coll_fn(case: dict[str, Any], rank: int) -> Any:
    import torch
    import torch.distributed as dist

    mb = 1 << 20
    if case["kind"] == "all_to_all":
        split = np.asarray(case["split_mb"]) * mb // 4
        send, recv = split[rank].astype(int).tolist(), split[:, rank].astype(int).tolist()
        x, y = torch.ones(sum(send)), torch.empty(sum(recv))
        return lambda: dist.all_to_all_single(y, x, recv, send)
    x = torch.ones(int(case["mb"] * mb // 4))
    if case["kind"] == "all_reduce":
        return lambda: dist.all_reduce(x)
    if case["kind"] == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if rank > 1:
        return lambda: None
    return (lambda: dist.send(x, 1)) if rank == 0 else (lambda: dist.recv(x, 0))


def pipe_step(case: dict[str, Any], rank: int, world: int) -> Any:
    """One training step of moebal's pipeline runner (this rank's stage): 1F1B or GPipe over `micro_batches`,
    point-to-point activations and gradients, the chain's small statistics all-reduce, clipping, AdamW."""
    import dataclasses

    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import PipelineRunner

    cfg = _cfg(case, pp=world)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule=case["schedule"],
                                                                micro_batches=case["micro_batches"]))
    dims = ParallelDims(world_size=world, rank=rank, pp=world).init()
    runner = PipelineRunner(cfg, dims=dims, record_ops=False)
    runner.start()
    return runner.train_step


def _layer_counts(model: Any, cfg: Any) -> np.ndarray | None:
    """[n_layers, E] assignments of the last forward (zeros for dense layers)."""
    if cfg.moe.num_experts == 0:
        return None
    out = np.zeros((cfg.model.n_layers, cfg.moe.num_experts))
    moe_idx = [i for i in range(cfg.model.n_layers) if cfg.is_moe_layer(i)]
    for i, layer in zip(moe_idx, model.moe_layers()):
        out[i] = layer.last_stats.counts_E.numpy()
    return out


# ---- phases: calibration probes and workloads interleaved round-robin ---------------------------------------
def phase_single(rounds: int, only: str | None) -> dict[str, Any]:
    """This process, 1 thread: fp32 compute probes interleaved with single-process training steps."""

    import torch

    from moebal.commands import calibrate as cal

    torch.set_num_threads(1)
    probes = cal.compute_probes(dtypes=("fp32",))
    steps, models = {}, {}
    for case in MODEL_CASES:
        if only is None or only in case["name"]:
            steps[case["name"]], models[case["name"]] = model_step(case)
    samples = cal.round_robin({**{k: fn for k, (_, fn) in probes.items()}, **steps}, rounds)
    counts = {c["name"]: _layer_counts(models[c["name"]], _cfg(c)) for c in MODEL_CASES if c["name"] in models}
    compute = {stat: cal.compute_records(probes, {k: f(v) for k, v in samples.items()}) for stat, f in STATS.items()}
    return {"compute": compute, "samples": {k: samples[k] for k in steps}, "counts": counts}


def _world_worker(rank: int, world: int, rounds: int, only: str | None) -> dict[str, Any]:
    """On `world` gloo ranks: collective probes (and, at 2 ranks, fp32 compute probes on both ranks at once and
    the expert-parallel steps) interleaved with the validation collectives."""

    import torch

    from moebal.commands import calibrate as cal

    torch.set_num_threads(1)
    probes = cal.collective_probes(rank, world, CAL_SIZES)
    if world == 2:
        probes.update(cal.compute_probes(dtypes=("fp32",)))
    fns = {k: fn for k, (_, fn) in probes.items()}
    models = {}
    for case in COLL_CASES:
        if case["world"] == world and (only is None or only in case["name"]):
            fns[case["name"]] = coll_fn(case, rank)
    if world == 2:
        for case in EP_CASES:
            if only is None or only in case["name"]:
                fns[case["name"]], models[case["name"]] = ep_step(case, rank, world)
        for case in PIPE_CASES:
            if only is None or only in case["name"]:
                fns[case["name"]] = pipe_step(case, rank, world)
    samples = cal.synced_round_robin(fns, rounds)
    coll = {stat: [{**meta, "s": f(samples[k])} for k, (meta, _) in probes.items() if k.startswith("coll")]
            for stat, f in STATS.items()}
    compute = {stat: cal.compute_records(probes, {k: f(v) for k, v in samples.items()}) for stat, f in STATS.items()}
    out = {"collective": coll, "compute": compute,
           "samples": {k: v for k, v in samples.items() if k not in probes},
           "counts": {k: _layer_counts(m, _cfg(next(c for c in EP_CASES if c["name"] == k))).tolist()
                      for k, m in models.items()}}
    return out


def phase_world(world: int, rounds: int, only: str | None) -> dict[str, Any]:
    from moebal.distributed.testing import run_ranks

    res = run_ranks(_world_worker, world, rounds, only, timeout_s=1800.0)
    out = res[0]
    out["counts"] = {k: np.stack([np.asarray(r["counts"][k]) for r in res], axis=1) for k in out["counts"]}
    return out


# ---- predictions --------------------------------------------------------------------------------------------
def predict_model(case: dict[str, Any], counts_LE: np.ndarray | None, cost: Any) -> float:
    from moebal.planner.cost import ModelShape
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    cfg = _cfg(case)
    spec = SimSpec(layout=Layout(1), micro_batch_size=case["batch"], seq_len=case["seq"], count_exchange=False)
    counts = None if counts_LE is None else counts_LE[:, None, None, :]
    return simulate(ModelShape.from_config(cfg), cost, spec, counts).iteration_time_s


def predict_ep(case: dict[str, Any], counts_LRE: np.ndarray, cost: Any, world: int = 2) -> float:
    from moebal.planner.cost import ModelShape
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    cfg = _cfg(case)
    # moebal's EP step: blocking Trans before the forward, Agg after the backward, one flat all-reduce of the
    # non-expert gradients after the backward, Trans/Agg as point-to-point fan-out.
    spec = SimSpec(layout=Layout(world, ep=world), micro_batch_size=case["batch"], seq_len=case["seq"],
                   dp_overlap=False, bucket_bytes=float("inf"), trans_algorithm="fanout")
    pls = _placements(case["placement"], cfg.moe.num_experts, world, cfg.model.n_layers)
    return simulate(ModelShape.from_config(cfg), cost, spec, counts_LRE[:, None], [[p] for p in pls]).iteration_time_s


def predict_pipe(case: dict[str, Any], cost: Any, world: int = 2) -> float:
    from moebal.planner.cost import ModelShape
    from moebal.sim.program import Layout, SimSpec
    from moebal.sim.simulate import simulate

    cfg = _cfg(case, pp=world)
    m = case["micro_batches"]
    spec = SimSpec(layout=Layout(world, pp=world), micro_batches=m, micro_batch_size=case["batch"] // m,
                   seq_len=case["seq"], schedule=case["schedule"], count_exchange=False)
    return simulate(ModelShape.from_config(cfg), cost, spec, None).iteration_time_s


def predict_coll(case: dict[str, Any], cost: Any) -> float:
    w, mb = case["world"], float(1 << 20)
    topo = cost.topology(w)
    if case["kind"] == "all_to_all":
        b = np.asarray(case["split_mb"]) * mb
        np.fill_diagonal(b, 0.0)  # a rank's block for itself is a local copy
        coll = cost.all_to_all(topo, range(w), b)
    elif case["kind"] == "all_reduce":
        coll = cost.all_reduce(topo, range(w), case["mb"] * mb)
    elif case["kind"] == "broadcast":
        coll = cost.broadcast(topo, 0, range(w), case["mb"] * mb)
    else:
        coll = cost.p2p(topo, 0, 1, case["mb"] * mb)
    return cost.time_of(coll, topo)


# ---- driver -------------------------------------------------------------------------------------------------
def _record(name: str, kind: str, case: dict[str, Any], samples: list[float], pred: float,
            profile: str) -> dict[str, Any]:
    meas = statistics.median(samples)
    return {"name": name, "kind": kind, "config": {k: v for k, v in case.items() if k != "name"},
            "measured_s": meas, "predicted_s": pred, "error": (pred - meas) / meas, "samples_s": samples,
            "profile": profile}


def _fit(single: dict[str, Any], worlds: dict[int, dict[str, Any]], stat: str) -> tuple[Any, Any]:
    """Profiles fitted from the probes' `stat` figures: 1 process busy, and 2 processes busy."""
    from moebal.planner.hardware_fit import fit_profile

    coll = [r for w in worlds.values() for r in w["collective"].get(stat, [])]
    kw = {"source": ["scripts/validate_simulator.py"], "calibration": {"statistic": stat}}
    prof1 = fit_profile({**single["compute"][stat], "collective": coll}, name=f"validation-1proc-{stat}",
                        description="fitted in the validation run (1 process)", **kw)
    two = worlds[2]["compute"].get(stat) or single["compute"][stat]
    prof2 = fit_profile({**two, "collective": coll}, name=f"validation-2proc-{stat}",
                        description="fitted in the validation run (2 processes busy)", **kw)
    return prof1, prof2


def _predictions(single: dict[str, Any], worlds: dict[int, dict[str, Any]], prof1: Any,
                 prof2: Any) -> dict[str, tuple[str, str, list[float], float, str]]:
    """name -> (kind, case, samples, predicted seconds, profile name)."""
    from moebal.planner.cost import CostModel

    cost1, cost2 = CostModel(prof1, "fp32"), CostModel(prof2, "fp32")
    out: dict[str, Any] = {}
    for case in MODEL_CASES:
        if case["name"] in single["samples"]:
            out[case["name"]] = ("model", case, single["samples"][case["name"]],
                                 predict_model(case, single["counts"][case["name"]], cost1), prof1.name)
    w2 = worlds[2]
    for case in EP_CASES:
        if case["name"] in w2["samples"]:
            out[case["name"]] = ("ep", case, w2["samples"][case["name"]],
                                 predict_ep(case, w2["counts"][case["name"]], cost2), prof2.name)
    for case in PIPE_CASES:
        if case["name"] in w2["samples"]:
            out[case["name"]] = ("pipeline", case, w2["samples"][case["name"]], predict_pipe(case, cost2), prof2.name)
    for case in COLL_CASES:
        if case["name"] in worlds[case["world"]]["samples"]:
            out[case["name"]] = ("collective", case, worlds[case["world"]]["samples"][case["name"]],
                                 predict_coll(case, cost1), prof1.name)
    return out


def validate(rounds: int, only: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from moebal.commands.calibrate import summary

    single = phase_single(rounds, only)
    needed = {c["world"] for c in COLL_CASES if only is None or only in c["name"]}
    if any(only is None or only in c["name"] for c in EP_CASES + PIPE_CASES):
        needed.add(2)
    empty = {"collective": {}, "compute": {}, "samples": {}, "counts": {}}
    worlds = {w: phase_world(w, rounds, only) if w in needed else empty for w in (2, 3, 4)}
    fits, preds = {}, {}
    for stat in STATS:
        prof1, prof2 = _fit(single, worlds, stat)
        fits[stat] = {"single_process": summary(prof1, prof1.name), "two_process": summary(prof2, prof2.name)}
        preds[stat] = _predictions(single, worlds, prof1, prof2)
    records = []
    for name, (kind, case, samples, pred, prof) in preds["median"].items():
        rec = _record(name, kind, case, samples, pred, prof)
        low = min(samples)
        rec.update({"measured_min_s": low, "predicted_min_s": preds["min"][name][3],
                    "error_min": (preds["min"][name][3] - low) / low})
        records.append(rec)
    return records, fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="write the records (a JSON list) to FILE and the "
                    "summary, fitted profiles and environment to FILE with suffix .summary.json")
    ap.add_argument("--png", default=None, metavar="FILE", help="write predicted vs measured as a scatter plot")
    ap.add_argument("--rounds", type=int, default=7, help="round-robin rounds (every figure is a median of them)")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this text")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)

    import os

    from moebal.kernels.bench import environment

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    records, fits = validate(args.rounds, args.only)
    load_after = os.getloadavg()
    for rec in records:
        print(f"{rec['name']:<40} measured {rec['measured_s'] * 1e3:9.2f} ms  predicted "
              f"{rec['predicted_s'] * 1e3:9.2f} ms  error {rec['error'] * 100:+6.1f}%   (minimums: "
              f"{rec['error_min'] * 100:+6.1f}%)")
    errs = [abs(r["error"]) for r in records]
    errs_min = [abs(r["error_min"]) for r in records]
    summary = {"records": len(records), "median_abs_error": statistics.median(errs) if errs else None,
               "median_abs_error_min_statistic": statistics.median(errs_min) if errs_min else None,
               "max_abs_error": max(errs) if errs else None, "within_15pct": sum(e <= 0.15 for e in errs),
               "wall_s": round(time.perf_counter() - t0, 1),
               # other jobs on the machine: the 1-minute load average before and after (cores: os.cpu_count())
               "load_average": [round(load_before[0], 2), round(load_after[0], 2)], "cores": os.cpu_count()}
    print(json.dumps(summary))
    if args.json:
        # the records file is a list of records (config, measured_s, predicted_s, ...); the summary, the fitted
        # profiles and the environment go next to it
        Path(args.json).write_text(json.dumps(records, indent=1), encoding="utf-8")
        side = Path(args.json).with_suffix(".summary.json")
        side.write_text(json.dumps({"summary": summary, "fitted_profiles": fits, "environment": environment()},
                                   indent=1), encoding="utf-8")
    if args.png and records:
        _plot(records, args.png)
    return 0


def _plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for kind, marker in (("model", "o"), ("ep", "s"), ("pipeline", "D"), ("collective", "^")):
        pts = [(r["measured_s"] * 1e3, r["predicted_s"] * 1e3) for r in records if r["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=kind)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in records) * 1e3 * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in records) * 1e3 * 1.2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.85, xs * 1.15, color="grey", alpha=0.2, label="+-15%")
    ax.set(xscale="log", yscale="log", xlabel="measured ms (median)", ylabel="predicted ms",
           title="simulator vs measured moebal runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
