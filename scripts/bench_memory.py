"""The memory plan against measured peaks: real `moebal train` runs on 4 gloo ranks of this machine.

Each layout trains a small MoE model (about 80M parameters; fp32; the first 2 MB of the stdlib corpus) for a
few steps as 4 rank processes started here with the torchrun environment (`moebal train` with RANK set). The
measured peak of a rank is the `ru_maxrss` of its process (`os.wait4`), the predicted one
`moebal.planner.memory.plan_memory` on the CPU device (`DeviceMemory.cpu`: the fitted runtime constant and
slack). Layouts whose settings the config refuses (parallel.shard and train.recompute are not built in every
branch) are recorded as skipped with the refusal, with their predicted peaks only.

For each setting it also reports the memory it saves against its base layout and its throughput cost (the
tokens/s of rank 0's summary), measured where both ran and predicted otherwise.

    python scripts/bench_memory.py [--json m.json] [--quick] [--only NAME,...] [--steps N]
    python scripts/bench_memory.py --fit-baseline [--json b.json]   (the CPU runtime constant's own runs)
    python scripts/bench_memory.py --fit-full-slack [--json f.json] (the CPU slack under parallel.shard=full)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moebal.commands.bench import at_least
from moebal.config import Config
from moebal.errors import ConfigError

RANKS = 4
MODEL = ["model.dim=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=1536",
         "moe.num_experts=8", "moe.expert_ffn_dim=1536", "model.max_seq_len=512"]
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=128",
        "moe.num_experts=4", "moe.expert_ffn_dim=64", "model.max_seq_len=128"]
COMMON = ["train.precision=fp32", "data.max_bytes=2000000", "train.eval_every=0", "train.eval_batches=1",
          "train.warmup_steps=1", "train.time_limit_min=null", "planner.policy=static", "scheduler.trace_step=0",
          "scheduler.events=false", "train.threads=1", "data.val_fraction=0"]


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    base: str | None = None
    """The layout this one changes one setting of (for memory saved / throughput cost)."""
    setting: str = ""
    quick: bool = False
    model: tuple[str, ...] = field(default=tuple(MODEL))


CASES = [
    Case("dp4", ("parallel.ep=1", "data.batch_size=16", "data.seq_len=128")),
    Case("ep4", ("parallel.ep=4", "data.batch_size=16", "data.seq_len=128"), "dp4", "parallel.ep=4", quick=True),
    Case("ep2_dp2", ("parallel.ep=2", "data.batch_size=16", "data.seq_len=128"), "dp4", "parallel.ep=2"),
    Case("ep4_batch32", ("parallel.ep=4", "data.batch_size=32", "data.seq_len=128"), "ep4", "data.batch_size=32"),
    Case("ep4_seq256", ("parallel.ep=4", "data.batch_size=16", "data.seq_len=256"), "ep4", "data.seq_len=256"),
    Case("pp2_ep2", ("parallel.pp=2", "parallel.ep=2", "pipeline.micro_batches=2", "data.batch_size=16",
                     "data.seq_len=128"), "ep4", "parallel.pp=2"),
    Case("pp4", ("parallel.pp=4", "parallel.ep=1", "pipeline.micro_batches=4", "data.batch_size=16",
                 "data.seq_len=128"), "dp4", "parallel.pp=4"),
    Case("pp2_dp2", ("parallel.pp=2", "parallel.ep=1", "pipeline.micro_batches=4", "data.batch_size=16",
                     "data.seq_len=128"), "dp4", "parallel.pp=2"),
    Case("ep4_shard_optimizer", ("parallel.ep=4", "parallel.shard=optimizer", "data.batch_size=16",
                                 "data.seq_len=128"), "ep4", "parallel.shard=optimizer"),
    Case("dp4_shard_optimizer", ("parallel.ep=1", "parallel.shard=optimizer", "data.batch_size=16",
                                 "data.seq_len=128"), "dp4", "parallel.shard=optimizer"),
    Case("dp4_shard_full", ("parallel.ep=1", "parallel.shard=full", "data.batch_size=16", "data.seq_len=128"),
         "dp4", "parallel.shard=full"),
    Case("ep2_dp2_shard_full", ("parallel.ep=2", "parallel.shard=full", "data.batch_size=16", "data.seq_len=128"),
         "ep2_dp2", "parallel.shard=full"),
    Case("ep4_recompute_full", ("parallel.ep=4", "train.recompute=full", "data.batch_size=16", "data.seq_len=256"),
         "ep4_seq256", "train.recompute=full"),
    Case("ep4_recompute_moe", ("parallel.ep=4", "train.recompute=moe", "data.batch_size=16", "data.seq_len=256"),
         "ep4_seq256", "train.recompute=moe"),
    Case("ep4_recompute_attention", ("parallel.ep=4", "train.recompute=attention", "data.batch_size=16",
                                     "data.seq_len=256"), "ep4_seq256", "train.recompute=attention"),
    Case("ep4_grad_accum4", ("parallel.ep=4", "train.grad_accum=4", "data.batch_size=16", "data.seq_len=256"),
         "ep4_seq256", "train.grad_accum=4"),
    Case("ep4_one_stage_moe", ("parallel.ep=4", "dynamism.scheme=moe", "pipeline.micro_batches=4",
                               "data.batch_size=16", "data.seq_len=256"),
         "ep4_grad_accum4", "dynamism.scheme=moe (a one-stage pipeline of 4 micro-batches)"),
    Case("dp4_shard_full_accum4", ("parallel.ep=1", "parallel.shard=full", "train.grad_accum=4", "data.batch_size=16",
                                   "data.seq_len=128"), "dp4_shard_full", "train.grad_accum=4"),
    Case("dp4_shard_full_accum4_whole", ("parallel.ep=1", "parallel.shard=full", "train.grad_accum=4",
                                         "parallel.accumulate=whole", "data.batch_size=16", "data.seq_len=128"),
         "dp4_shard_full_accum4", "parallel.accumulate=whole"),
    Case("dp4_shard_full_accum4_whole_step", ("parallel.ep=1", "parallel.shard=full", "train.grad_accum=4",
                                              "parallel.accumulate=whole", "parallel.reshard=step",
                                              "data.batch_size=16", "data.seq_len=128"),
         "dp4_shard_full_accum4_whole", "parallel.reshard=step"),
]
BASELINE_CASES = [
    Case("tiny_ep4", ("parallel.ep=4", "data.batch_size=16", "data.seq_len=64"), model=tuple(TINY)),
    Case("tiny_dp4", ("parallel.ep=1", "data.batch_size=16", "data.seq_len=64"), model=tuple(TINY)),
]
CALIBRATION = ["model.dim=384", "model.n_layers=3", "model.n_heads=6", "model.n_kv_heads=6", "model.ffn_dim=1152",
               "moe.num_experts=8", "moe.expert_ffn_dim=1152", "model.max_seq_len=512"]
CALIBRATION_CASES = [  # another model than the validation layouts': the slack constants' own data
    Case("cal_ep4", ("parallel.ep=4", "data.batch_size=16", "data.seq_len=128"), model=tuple(CALIBRATION)),
    Case("cal_dp4", ("parallel.ep=1", "data.batch_size=16", "data.seq_len=128"), model=tuple(CALIBRATION)),
    Case("cal_pp2_dp2", ("parallel.pp=2", "parallel.ep=1", "pipeline.micro_batches=2", "data.batch_size=16",
                         "data.seq_len=128"), model=tuple(CALIBRATION)),
]

CALIBRATION_FULL_CASES = [  # the calibration model under `parallel.shard: full`: CPU_FULL_SHARD_SLACK's own data
    Case("cal_dp4_shard_full", ("parallel.ep=1", "parallel.shard=full", "data.batch_size=16", "data.seq_len=128"),
         model=tuple(CALIBRATION)),
]


def overrides(case: Case, steps: int) -> list[str]:
    return [*case.model, *COMMON, *case.overrides, f"train.steps={steps}", f"train.ckpt_every={steps + 1}"]


def refusal(case: Case, steps: int) -> str | None:
    """The config's refusal of this layout in this build, or None when it runs."""
    from moebal.config import load

    try:
        load(None, overrides(case, steps))
    except ConfigError as e:
        return str(e)
    return None


def plan_config(case: Case, steps: int) -> Config:
    """The run's config for the plan: refused settings (not built here) are planned from the overrides."""
    from moebal.config import load

    rest = [o for o in overrides(case, steps) if not o.startswith(("parallel.shard=", "train.recompute="))]
    return load(None, rest)


def predict(case: Case, steps: int, runtime: bool = True, skew: float = 1.0) -> dict[str, Any]:
    """The plan of a case on this machine's CPU (runtime False: the model's bytes alone, no CPU constants), with
    the busiest rank's routed rows `skew` times the mean."""
    from moebal.planner.memory import DeviceMemory, choose_shard, layout_from_config, plan_memory

    cfg = plan_config(case, steps)
    given = dict(o.split("=", 1) for o in case.overrides)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dev = DeviceMemory.cpu(ram, RANKS)
    kw = {"recompute": given.get("train.recompute"), "routing_skew": skew}
    shard = given.get("parallel.shard")
    if shard is None:  # parallel.shard auto, the default: the run settles it as `moebal train` does
        shard = choose_shard(cfg, RANKS, dev, "fp32", **kw)[0].parallel.shard
    lay = layout_from_config(cfg, RANKS, shard=shard, precision="fp32", **kw)
    if not runtime:
        dev = DeviceMemory(name=dev.name, capacity_bytes=dev.capacity_bytes, runtime_bytes=0.0, slack=0.0,
                           startup_retained=0.0)
    plan = plan_memory(cfg, lay, dev)
    return {"layout": lay.describe(), "peak_bytes": plan.peak_bytes, "terms": plan.to_dict()["terms"],
            "stage_peaks": list(plan.stage_peaks), "phases": plan.to_dict()["phases"],
            "stage_train_bytes": list(plan.stage_train), "stage_freed_bytes": list(plan.stage_freed)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(case: Case, steps: int, workdir: Path) -> dict[str, Any]:
    """Train the layout on RANKS rank processes; each rank's ru_maxrss and rank 0's summary."""
    from moebal.train.rundir import LOCK_ENV, LOCK_NAME, lock_run_dir

    out = workdir / case.name
    port = _port()
    argv = [sys.executable, "-m", "moebal.cli", "train", *overrides(case, steps), "--out", str(out)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(RANKS),
           "LOCAL_WORLD_SIZE": str(RANKS), "OMP_NUM_THREADS": "1", LOCK_ENV: str((out / LOCK_NAME).resolve())}
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    with lock_run_dir(out):
        # files, not pipes: a full pipe would block a rank
        logs = [open(out / f"rank{r}.log", "wb") for r in range(RANKS)]  # noqa: SIM115 - closed below
        procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in range(RANKS)]
        rss: dict[int, int] = {}
        codes: dict[int, int] = {}
        pids = {p.pid: r for r, p in enumerate(procs)}
        while len(rss) < RANKS:
            pid, status, usage = os.wait4(-1, 0)  # the rusage of that one child: its own peak RSS
            if pid in pids:
                rss[pids[pid]] = usage.ru_maxrss * 1024  # Linux reports KiB
                codes[pids[pid]] = procs[pids[pid]].returncode = os.waitstatus_to_exitcode(status)
        for f in logs:
            f.close()
        errors = {r: (out / f"rank{r}.log").read_text(errors="replace")[-1500:] for r in range(RANKS) if codes[r]}
    wall = time.perf_counter() - t0
    if errors:
        return {"status": "failed", "exit_codes": codes, "stderr_tail": errors, "wall_s": wall}
    summary = json.loads((out / "summary.json").read_text())
    counts = [json.loads(line).get("expert_counts") for line in (out / "metrics.jsonl").read_text().splitlines()
              if line.strip()]
    return {"status": "ok", "rss_bytes": [rss[r] for r in range(RANKS)], "tokens_per_s": summary["tokens_per_s"],
            "wall_s": wall, "expert_counts": [c for c in counts if c]}


def rank_skews(counts_steps: list[list[list[float]]], ep: int) -> list[float]:
    """Per expert-parallel rank: its routed rows over the MoE layers / the mean rank's, at the step where that is
    largest (experts in contiguous blocks of E / ep per rank, as `default_owners`)."""
    out = [1.0] * ep
    for layers in counts_steps:
        per_rank = [0.0] * ep
        total = 0.0
        for counts_E in layers:
            E = len(counts_E)
            for e, c in enumerate(counts_E):
                per_rank[e // (E // ep)] += c
                total += c
        if total:
            out = [max(o, x / (total / ep)) for o, x in zip(out, per_rank)]
    return out


def run_case(case: Case, steps: int, workdir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"name": case.name, "overrides": list(case.overrides), "base": case.base,
                           "setting": case.setting}
    why = refusal(case, steps)
    try:
        row["predicted"] = predict(case, steps)
    except ConfigError as e:
        row["predicted"] = {"error": str(e)}
    if why is not None:
        row.update(status="skipped", reason=f"refused by the config in this build: {why}")
        return row
    row.update(measure(case, steps, workdir))
    if row["status"] == "ok" and "peak_bytes" in row["predicted"]:
        ep = int(dict(o.split("=", 1) for o in case.overrides).get("parallel.ep", 1))
        pp = int(dict(o.split("=", 1) for o in case.overrides).get("parallel.pp", 1))
        if ep > 1:  # the plan's routing-skew input, observed: the rank that owns the hot experts computes their rows
            skews = rank_skews(row.pop("expert_counts"), ep)
            row["rank_skew"] = [skews[(r % (RANKS // pp)) % ep] for r in range(RANKS)]
        row.pop("expert_counts", None)
        score(case, row, steps)
    return row


def run_rounds(cases: list[Case], steps: int, workdir: Path, rounds: int) -> list[dict[str, Any]]:
    """Every case `rounds` times, round k starting at case k (rotated): the first round's rows, each with every
    round's throughput, peaks and wall time under `rounds` when there is more than one."""
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    for k in range(rounds):
        for c in cases[k % len(cases):] + cases[:k % len(cases)] if cases else []:
            print(f"bench_memory: {c.name} (round {k + 1} of {rounds}) ...", file=sys.stderr, flush=True)
            runs[c.name].append(run_case(c, steps, workdir / f"round{k}"))
    rows = [runs[c.name][0] for c in cases]
    if rounds > 1:
        for row in rows:
            row["rounds"] = [{k: r.get(k) for k in ("status", "tokens_per_s", "rss_bytes", "wall_s")}
                             for r in runs[row["name"]]]
    return rows


def score(case: Case, row: dict[str, Any], steps: int) -> None:
    """The plan's per-rank predictions and errors of a measured row (its `rss_bytes`, and `rank_skew` under
    expert parallelism), into `row`."""
    per_rank = _per_rank_prediction(case, row["predicted"])
    row["predicted_rank_bytes_skew1"] = per_rank
    if "rank_skew" in row:
        per_rank = [_per_rank_prediction(case, predict(case, steps, skew=s))[r] for r, s in enumerate(row["rank_skew"])]
    row["predicted_rank_bytes"] = per_rank
    row["error_per_rank"] = [(p - m) / m for p, m in zip(per_rank, row["rss_bytes"])]
    row["error"] = (max(per_rank) - max(row["rss_bytes"])) / max(row["rss_bytes"])


def rescore(paths: list[str], steps: int) -> list[dict[str, Any]]:
    """The rows of earlier runs' JSON (the last file's row wins per layout) scored by the plan as it is now: the
    measured peaks and routing skews kept, the predictions and errors recomputed (`before_*`: the file's own)."""
    by_name = {c.name: c for c in CASES}
    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        for old in json.loads(Path(path).read_text())["rows"]:
            case = by_name.get(old["name"])
            if case is None or old.get("status") != "ok":
                continue
            row = {k: old[k] for k in ("name", "overrides", "base", "setting", "status", "rss_bytes", "tokens_per_s",
                                       "wall_s", "rank_skew") if k in old}
            row.update(source=path, before_error=old.get("error"), before_rank_bytes=old.get("predicted_rank_bytes"))
            row["predicted"] = predict(case, steps)
            score(case, row, steps)
            rows[case.name] = row
    return [rows[c.name] for c in CASES if c.name in rows]


def _per_rank_prediction(case: Case, pred: dict[str, Any]) -> list[float]:
    """A pipeline's stage s runs on ranks s * (RANKS / pp) ... (torchrun order: stage-major); else every rank."""
    stages = pred["stage_peaks"]
    per = RANKS // len(stages)
    return [stages[r // per] for r in range(RANKS)]


def savings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Memory saved by each setting against its base (the largest rank's peak) and its throughput cost."""
    by = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        base = by.get(r.get("base") or "")
        if base is None:
            continue
        rec: dict[str, Any] = {"setting": r["setting"], "layout": r["name"], "base": base["name"]}
        p0, p1 = base["predicted"].get("peak_bytes"), r["predicted"].get("peak_bytes")
        if p0 and p1:
            rec["predicted_saved_bytes"] = p0 - p1
            rec["predicted_ratio"] = p1 / p0
            t0, t1 = base["predicted"]["terms"], r["predicted"]["terms"]
            state = ("parameters", "gradients", "optimizer state", "persistent gradient buffers")
            rec["predicted_model_state_ratio"] = sum(t1[k] for k in state) / max(sum(t0[k] for k in state), 1)
            rec["predicted_activation_ratio"] = t1["activations"] / max(t0["activations"], 1)
        if r.get("status") == "ok" and base.get("status") == "ok":
            m0, m1 = max(base["rss_bytes"]), max(r["rss_bytes"])
            rec.update(measured_saved_bytes=m0 - m1, measured_ratio=m1 / m0,
                       throughput_cost=base["tokens_per_s"] / r["tokens_per_s"])
            if "rounds" in r and "rounds" in base:  # paired by round: both ran in it, one after the other
                costs = [b["tokens_per_s"] / x["tokens_per_s"] for b, x in zip(base["rounds"], r["rounds"])
                         if b["status"] == x["status"] == "ok"]
                rec.update(throughput_cost_rounds=costs,
                           throughput_cost=statistics.median(costs) if costs else rec["throughput_cost"])
        else:
            rec["measured"] = "skipped: " + ("this layout" if r.get("status") != "ok" else "its base") + " did not run"
        out.append(rec)
    return out


def fit_baseline(steps: int, workdir: Path) -> dict[str, Any]:
    """The CPU runtime constant: measured peak RSS minus the predicted model terms of tiny models."""
    rows = []
    for case in BASELINE_CASES:
        m = measure(case, steps, workdir)
        if m["status"] != "ok":
            rows.append({"name": case.name, **m})
            continue
        p = predict(case, steps, runtime=False)
        rows.append({"name": case.name, "rss_bytes": m["rss_bytes"], "model_terms_bytes": p["peak_bytes"],
                     "runtime_bytes": [x - p["peak_bytes"] for x in m["rss_bytes"]]})
    fitted = [x for r in rows for x in r.get("runtime_bytes", [])]
    runtime = statistics.median(fitted) if fitted else 0.0
    return {"rows": rows, "runtime_bytes_median": runtime, **fit_slack(steps, workdir, runtime)}


def fit_slack(steps: int, workdir: Path, runtime: float) -> dict[str, Any]:
    """The CPU allocator constants, by least squares over every rank of CALIBRATION_CASES:
    rss - runtime - train = slack * train + retained * freed (train: the training phases' bytes of the rank's
    stage; freed: what its start-up built and then freed)."""
    import numpy as np

    A, b, rows = [], [], []
    for case in CALIBRATION_CASES:
        m = measure(case, steps, workdir)
        rows.append({"name": case.name, **m})
        if m["status"] != "ok":
            continue
        given = dict(o.split("=", 1) for o in case.overrides)
        ep = int(given.get("parallel.ep", 1))
        skews = rank_skews(m.pop("expert_counts"), ep) if ep > 1 else [1.0]
        for r, rss in enumerate(m["rss_bytes"]):
            p = predict(case, steps, runtime=False, skew=skews[r % ep])
            per = RANKS // len(p["stage_train_bytes"])
            train, freed = p["stage_train_bytes"][r // per], p["stage_freed_bytes"][r // per]
            A.append([train, freed])
            b.append(rss - runtime - train)
        rows[-1]["rank_skew"] = [skews[r % ep] for r in range(RANKS)]
    if not A:
        return {"calibration_rows": rows}
    (slack, retained), *_ = np.linalg.lstsq(np.array(A), np.array(b), rcond=None)
    return {"calibration_rows": rows, "allocator_slack": float(slack), "startup_retained": float(retained)}


def fit_full_slack(steps: int, workdir: Path) -> dict[str, Any]:
    """The CPU allocator slack under `parallel.shard: full`, by least squares over every rank of
    CALIBRATION_FULL_CASES with the fitted runtime and start-up constants: rss - runtime - body = slack * body
    (body: the rank's largest training phase plus its start-up leftovers)."""
    from moebal.planner.memory import CPU_RUNTIME_BYTES, CPU_STARTUP_RETAINED

    num = den = 0.0
    rows = []
    for case in CALIBRATION_FULL_CASES:
        m = measure(case, steps, workdir)
        m.pop("expert_counts", None)
        rows.append({"name": case.name, **m})
        if m["status"] != "ok":
            continue
        p = predict(case, steps, runtime=False)
        per = RANKS // len(p["stage_train_bytes"])
        bodies = []
        for r, rss in enumerate(m["rss_bytes"]):
            body = p["stage_train_bytes"][r // per] + CPU_STARTUP_RETAINED * p["stage_freed_bytes"][r // per]
            num += body * (rss - CPU_RUNTIME_BYTES - body)
            den += body * body
            bodies.append(body)
        rows[-1]["body_bytes"] = bodies
    out: dict[str, Any] = {"calibration_full_rows": rows}
    if den:
        out["full_shard_slack"] = num / den
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="one layout (ep4) and the refused ones")
    ap.add_argument("--only", help="comma list of layout names")
    ap.add_argument("--steps", type=at_least(1), default=3, help="training steps per run (default 3)")
    ap.add_argument("--rounds", type=at_least(1), default=1,
                    help="runs of every layout, the order rotated each round; peaks and errors are the first "
                         "round's, throughput costs the median of the rounds' side-by-side ratios (default 1)")
    ap.add_argument("--fit-baseline", action="store_true", help="measure the CPU runtime constant instead")
    ap.add_argument("--fit-full-slack", action="store_true",
                    help="measure the CPU allocator slack under parallel.shard=full instead")
    ap.add_argument("--rescore", nargs="+", metavar="JSON",
                    help="run nothing: score earlier runs' measured rows with the plan as it is now")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - {c.name for c in CASES}) if args.only else []
    if unknown:
        ap.error(f"--only: no layout named {', '.join(unknown)}; layouts: {', '.join(c.name for c in CASES)}")
    for path in args.rescore or []:
        try:
            json.loads(Path(path).read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--rescore {path}: not a JSON file of this benchmark's rows ({type(e).__name__}: {e})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        if args.fit_baseline:
            result: dict[str, Any] = {"baseline": fit_baseline(args.steps, Path(tmp))}
        elif args.fit_full_slack:
            result = {"full_slack": fit_full_slack(args.steps, Path(tmp))}
        else:
            cases = [c for c in CASES if (not args.only or c.name in args.only.split(","))
                     and (not args.quick or c.quick or refusal(c, args.steps))]
            rows = rescore(args.rescore, args.steps) if args.rescore else []
            if not args.rescore:
                rows = run_rounds(cases, args.steps, Path(tmp), args.rounds)
            errs = [abs(r["error"]) for r in rows if "error" in r]
            ranks = [abs(e) for r in rows for e in r.get("error_per_rank", [])]
            result = {"rows": rows, "savings": savings(rows),
                      "median_abs_error": statistics.median(errs) if errs else None,
                      "max_abs_error": max(errs) if errs else None, "validated_rows": len(errs),
                      "median_abs_error_per_rank": statistics.median(ranks) if ranks else None}
    import torch

    from moebal.planner.memory import CPU_ALLOCATOR_SLACK, CPU_RUNTIME_BYTES, CPU_STARTUP_RETAINED

    result["meta"] = {"ranks": RANKS, "steps": args.steps, "model": MODEL, "common": COMMON,
                      "cpu_runtime_bytes": CPU_RUNTIME_BYTES, "cpu_allocator_slack": CPU_ALLOCATOR_SLACK,
                      "cpu_startup_retained": CPU_STARTUP_RETAINED,
                      "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "torch": torch.__version__, "python": platform.python_version(),
                      "load_avg": os.getloadavg(), "wall_s": time.perf_counter() - t0}
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    if "full_slack" in result:
        f = result["full_slack"]
        for r in f["calibration_full_rows"]:
            print(f"{r['name']:<20} rss {[round(x / 1e6) for x in r.get('rss_bytes', [])]} MB, body "
                  f"{[round(x / 1e6) for x in r.get('body_bytes', [])]} MB ({r['status']})")
        if "full_shard_slack" in f:
            print(f"fitted allocator slack under parallel.shard=full: {f['full_shard_slack']:.3f}")
        return
    if "baseline" in result:
        b = result["baseline"]
        for r in b["rows"]:
            print(f"{r['name']:<12} rss {[round(x / 1e6) for x in r.get('rss_bytes', [])]} MB, "
                  f"runtime {[round(x / 1e6) for x in r.get('runtime_bytes', [])]} MB")
        print(f"median runtime constant: {(b['runtime_bytes_median'] or 0) / 1e6:.0f} MB")
        for r in b.get("calibration_rows", []):
            print(f"{r['name']:<12} rss {[round(x / 1e6) for x in r.get('rss_bytes', [])]} MB ({r['status']})")
        if "allocator_slack" in b:
            print(f"fitted allocator slack {b['allocator_slack']:.3f}, start-up retained {b['startup_retained']:.3f}")
        return
    print(f"{'layout':<26}{'measured max MB':>16}{'predicted MB':>14}{'error':>8}  per-rank MB (measured / predicted)")
    for r in result["rows"]:
        if r["status"] != "ok":
            pred = r["predicted"].get("peak_bytes")
            print(f"{r['name']:<26}{r['status']:>16}{(pred or 0) / 1e6:>14.0f}{'':>8}  {r.get('reason', '')[:70]}")
            continue
        meas = "/".join(f"{x / 1e6:.0f}" for x in r["rss_bytes"])
        pr = "/".join(f"{x / 1e6:.0f}" for x in r["predicted_rank_bytes"])
        print(f"{r['name']:<26}{max(r['rss_bytes']) / 1e6:>16.0f}{max(r['predicted_rank_bytes']) / 1e6:>14.0f}"
              f"{r['error'] * 100:>7.1f}%  {meas} / {pr}")
    if result["median_abs_error"] is not None:
        print(f"median |error| {result['median_abs_error'] * 100:.1f} % over {result['validated_rows']} layouts "
              f"(max {result['max_abs_error'] * 100:.1f} %); per rank "
              f"{result['median_abs_error_per_rank'] * 100:.1f} %")
    for s in result["savings"]:
        meas = (f"measured {s['measured_ratio']:.2f}x peak, throughput cost {s['throughput_cost']:.2f}x"
                if "measured_ratio" in s else s.get("measured", ""))
        if s.get("throughput_cost_rounds"):
            meas += " (rounds " + ", ".join(f"{c:.2f}x" for c in s["throughput_cost_rounds"]) + ")"
        print(f"  {s['setting']:<26} vs {s['base']:<12} predicted {s.get('predicted_ratio', float('nan')):.2f}x peak "
              f"(model state {s.get('predicted_model_state_ratio', float('nan')):.2f}x, activations "
              f"{s.get('predicted_activation_ratio', float('nan')):.2f}x); {meas}")


if __name__ == "__main__":
    sys.exit(main())
