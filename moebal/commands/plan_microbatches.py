"""`moebal plan microbatches`: DynaPipe micro-batching of one mini-batch, in one process (a dry run).

    moebal plan microbatches --lengths FILE --stages S [--memory BYTES] [--dp D] [--lockstep N] [--json]
                             [--cost TABLE.json | --config CONFIG --cluster PROFILE] [--method M|all]
    moebal plan microbatches --profile TABLE.json --config CONFIG --stages S [--max-len N] [--max-tokens N]

Lengths: a JSON list of integers (or an object with `lengths`), a text file with one integer per line, or a
.jsonl file with one sample per line (its `length` field, or the UTF-8 byte count of its text field, which
is its length under the byte tokenizer). Costs: a table measured on this machine (`--profile` writes one,
the pipeline runner too), or the hardware-profile model of `--config` on `--cluster` (default: the
DynaPipe paper's A100s). Every method runs side by side: DynaPipe's dynamic micro-batching, padding to the
batch maximum, packing into rows of the maximum length, and token-based micro-batching; each with its
micro-batch count searched on the cost model, as the paper grid-searches its baselines. `--lockstep N` plans as a
pipeline stage of N ranks that run every micro-batch together (expert-parallel shards, or every rank of a stage
whose MoE layers sum routing statistics: `Lockstep.of` in moebal/pipeline/planned.py), each its `MicroBatch.part`
of the rows: every micro-batch gets at least N rows and is costed at its largest rank's share.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.fileio import output_path, read_text
from moebal.planner.instructions import check_plan
from moebal.planner.microbatch import METHODS, MicroBatchPlan, plan_microbatches
from moebal.planner.microbatch_cost import MicroBatchCost, analytic_table, default_grid, load_cost

__all__ = ["add_microbatches_arguments", "read_lengths", "run_microbatches"]


def add_microbatches_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", help="sample lengths: JSON list, one integer per line, or .jsonl samples")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages")
    p.add_argument("--memory", type=float, help="activation bytes a stage may hold (default: no limit)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel pipelines (default 1)")
    p.add_argument("--lockstep", type=int, default=1, help="ranks of each pipeline that run every micro-batch "
                   "together, each a share of its rows (a stage's expert-parallel ranks; default 1)")
    p.add_argument("--method", default="all", choices=[*METHODS, "all"], help="micro-batching (default: all)")
    p.add_argument("--cost", metavar="TABLE", help="a micro-batch cost table (JSON, e.g. from --profile)")
    p.add_argument("--config", default=None, help="model (preset or YAML) for the hardware-profile cost model "
                   "(default: the DynaPipe paper's 3.35B GPT) or --profile (default: moebal's default config)")
    p.add_argument("--cluster", default="a100", help="hardware profile for the cost model (default a100)")
    p.add_argument("--dtype", default="bf16", help="cost-model dtype (default bf16)")
    p.add_argument("--max-len", type=int, help="longest allowed sample (default: the model's max_seq_len, "
                   "or the table's longest length)")
    p.add_argument("--max-tokens", type=int, help="largest micro-batch in tokens the table covers "
                   "(default 8 x max-len)")
    p.add_argument("--pad-multiple", type=int, default=8, help="round padded lengths up to this (default 8)")
    p.add_argument("--thin", type=float, default=0.01, help="thinning of the DP's time limits: the plan is "
                   "at most this share worse than the exact DP (0: exact; default 0.01)")
    p.add_argument("--micro-batches", type=int, help="baselines: fixed micro-batch count (default: searched)")
    p.add_argument("--profile", metavar="TABLE", help="measure a cost table on this machine for --config and "
                   "--stages, write it here, and stop")
    p.add_argument("--threads", type=int, default=1, help="--profile: intra-op threads (default 1, as a rank)")
    p.add_argument("--text-key", default="text", help=".jsonl field holding the text (default text)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def read_lengths(path: str, text_key: str = "text") -> list[Any]:
    """Sample lengths from a file (see the module docstring); ConfigError naming the line on bad input."""
    p = Path(path)
    text = read_text(p, "--lengths")
    if p.suffix == ".jsonl":
        out: list[Any] = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not a JSON object ({e})") from None
            if isinstance(rec, dict) and "length" in rec:
                out.append(rec["length"])
            elif isinstance(rec, dict) and isinstance(rec.get(text_key), str):
                out.append(len(rec[text_key].encode("utf-8")))
            else:
                raise ConfigError(f"{path}:{n}: a sample needs a 'length' or a string '{text_key}' field")
        return out
    if p.suffix == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lengths {path}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("lengths")
        if not isinstance(data, list):
            raise ConfigError(f"--lengths {path}: expected a list of integers or an object with 'lengths'")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append(int(line.strip()))
            except ValueError:
                raise ConfigError(f"{path}:{n}: {line.strip()!r} is not an integer length") from None
    return out


def _paper_gpt() -> Any:
    """The 4-GPU GPT of the DynaPipe paper (Table 1): 16 layers, dim 4096, 32 heads, FFN 16384, 3.35B. Its MLP
    is two matrices (GeLU); the cost model prices SwiGLU (three), so the FFN width is 2/3 of 16384: the same
    FLOPs, parameters and (about) the same stored activations."""
    from moebal.planner.cost import ModelShape

    return ModelShape(dim=4096, n_layers=16, n_heads=32, n_kv_heads=32, head_dim=128, ffn_dim=10923,
                      vocab_size=50304)


def paper_table(stages: int = 4, max_len: int = 4096) -> MicroBatchCost:
    """The cost table of the DynaPipe paper's GPT (`_paper_gpt`) on the `a100` profile in bf16, its layers split
    evenly over `stages`, the grid up to `max_len` tokens a sample and 8 x that a micro-batch (the setting of the
    planner's own benchmarks)."""
    shape = _paper_gpt()
    sizes = [len(x) for x in np.array_split(np.arange(shape.n_layers), stages)]
    b, s = default_grid(max_len, 8 * max_len)
    return analytic_table(shape, "a100", sizes, b, s, "bf16")


def _model(args: argparse.Namespace) -> tuple[Any, int]:
    from moebal.planner.cost import ModelShape

    if args.config is None:
        return _paper_gpt(), 8192
    from moebal.interop.hf_config import load

    cfg = load(args.config)
    return ModelShape.from_config(cfg), cfg.model.max_seq_len


def _cost(args: argparse.Namespace) -> tuple[MicroBatchCost, int]:
    if args.cost:
        table = load_cost(args.cost)
        if table.stages != args.stages:
            raise ConfigError(f"--cost {args.cost} has {table.stages} stages but --stages is {args.stages}")
        return table, args.max_len or table.max_len
    shape, model_max = _model(args)
    max_len = args.max_len or model_max
    if args.stages < 1 or args.stages > shape.n_layers:
        raise ConfigError(f"--stages {args.stages}: the model has {shape.n_layers} layers (1..{shape.n_layers})")
    sizes = [len(x) for x in np.array_split(np.arange(shape.n_layers), args.stages)]
    b, s = default_grid(max_len, args.max_tokens or 8 * max_len)
    return analytic_table(shape, args.cluster, sizes, b, s, args.dtype), max_len


def run_microbatches(args: argparse.Namespace) -> int:
    for flag, v in (("--max-len", args.max_len), ("--max-tokens", args.max_tokens)):
        if v is not None and v < 1:  # 0 would fall back to the default
            raise ConfigError(f"{flag} must be >= 1 (or left out for the default); got {v}")
    if args.profile:
        return _profile(args)
    if not args.lengths:
        raise ConfigError("moebal plan microbatches needs --lengths FILE (or --profile TABLE to measure costs)")
    if args.lockstep < 1:
        raise ConfigError(f"--lockstep {args.lockstep}: the ranks that run each micro-batch together; give at "
                          f"least 1 (1: a rank runs its micro-batches alone)")
    lengths = read_lengths(args.lengths, args.text_key)
    cost, max_len = _cost(args)
    methods = list(METHODS) if args.method == "all" else [args.method]
    plans: dict[str, MicroBatchPlan] = {}
    infeasible: dict[str, str] = {}  # with every method side by side, one that cannot plan this input is reported
    for m in methods:
        try:
            plans[m] = plan_microbatches(lengths, cost, method=m, dp=args.dp, memory=args.memory, max_len=max_len,
                                         pad_multiple=args.pad_multiple, thin=args.thin,
                                         num_micro=args.micro_batches, lockstep=args.lockstep)
        except ConfigError as e:
            if len(methods) == 1:
                raise
            infeasible[m] = str(e)
    if not plans:
        reasons = set(infeasible.values())
        if len(reasons) == 1:  # the lengths themselves (an empty or over-long sample): one reason, said once
            raise ConfigError(f"no method can plan these lengths: {reasons.pop()}")
        raise ConfigError("no method can plan these lengths: " + "; ".join(f"{m}: {why}" for m, why in
                                                                             infeasible.items()))
    report = {"samples": len(lengths), "tokens": int(sum(int(x) for x in lengths)), "stages": args.stages,
              "dp": args.dp, "lockstep": args.lockstep, "memory": args.memory, "max_len": max_len, "cost": cost.source,
              "plans": {m: _summary(p, plans) for m, p in plans.items()}, "infeasible": infeasible}
    if args.json:
        report["plans"] = {m: {**report["plans"][m], "plan": p.to_dict()} for m, p in plans.items()}
        print(json.dumps(report, indent=1))
        return 0
    _print(report, plans)
    return 0


def _summary(p: MicroBatchPlan, plans: dict[str, MicroBatchPlan]) -> dict[str, Any]:
    base = plans.get("padding")
    return {"micro_batches": len(p.micro_batches), "padding_efficiency": round(p.padding_efficiency, 4),
            "objective_s": p.objective_s, "predicted_time_s": p.predicted_time_s,
            "schedules": [r.schedule for r in p.replicas],
            "deadlock_free": all(bool(check_plan(r.streams)) for r in p.replicas),
            "speedup_vs_padding": (base.predicted_time_s / p.predicted_time_s) if base else None,
            "plan_s": round(p.meta["plan_s"], 4)}


def _print(report: dict[str, Any], plans: dict[str, MicroBatchPlan]) -> None:
    print(f"{report['samples']} samples, {report['tokens']} tokens (max {report['max_len']}) on {report['stages']} "
          f"stages x {report['dp']} data-parallel" + (f" x {report['lockstep']} ranks in lockstep"
                                                      if report["lockstep"] > 1 else "") + f"; costs: {report['cost']}")
    print(f"  {'method':<9}{'micro-batches':>14}{'padding eff':>12}{'Eq1':>11}{'simulated':>11}{'vs padding':>11}"
          f"  schedule     plan")
    for m, r in report["plans"].items():
        sp = f"{r['speedup_vs_padding']:.2f}x" if r["speedup_vs_padding"] else "-"
        print(f"  {m:<9}{r['micro_batches']:>14}{r['padding_efficiency']:>12.3f}{_fmt(r['objective_s']):>11}"
              f"{_fmt(r['predicted_time_s']):>11}{sp:>11}  {','.join(sorted(set(r['schedules']))):<12} "
              f"{r['plan_s'] * 1e3:.0f} ms{'' if r['deadlock_free'] else '  DEADLOCK'}")
    for m, why in report["infeasible"].items():
        print(f"  {m:<9}infeasible: {why}")
    dyn = plans.get("dynamic")
    if dyn is None:
        return
    print(f"dynamic: {dyn.meta.get('candidates_evaluated', 0)} of {dyn.meta['candidates']} time limits evaluated "
          f"({dyn.meta['candidates_exact']} before thinning {dyn.meta['thin']}), memory limit per micro-batch: "
          f"{dyn.meta['memory_mode']}")
    for d, rep in enumerate(dyn.replicas):
        shapes = [f"{dyn.micro_batches[j].size}x{dyn.micro_batches[j].seq}" for j in rep.micro_batches]
        cands = ", ".join(f"{n} {_fmt(t)}" for n, t, _ in rep.candidates)
        print(f"  replica {d}: {rep.schedule} ({cands}); micro-batches (rows x length) in order: "
              f"{' '.join(shapes[:24])}{' ...' if len(shapes) > 24 else ''}")
        if dyn.lockstep > 1:
            parts = ["/".join(str(len(dyn.micro_batches[j].part(k, dyn.lockstep))) for k in range(dyn.lockstep))
                     for j in rep.micro_batches]
            print(f"    rows per lockstep rank ({'/'.join(f'r{k}' for k in range(dyn.lockstep))}): "
                  f"{' '.join(parts[:24])}{' ...' if len(parts) > 24 else ''}")


def _fmt(t: float) -> str:
    return f"{t:.4g} s" if t >= 1 else f"{t * 1e3:.4g} ms"


def _profile(args: argparse.Namespace) -> int:
    import torch

    from moebal.interop.hf_config import load
    from moebal.pipeline.microbatch_profile import profile_table

    cfg = load(args.config)
    max_len = args.max_len or cfg.model.max_seq_len
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # as a pipeline rank runs: one intra-op thread by default
    try:
        table = profile_table(cfg, args.stages, max_len=max_len, max_tokens=args.max_tokens or 8 * max_len)
    finally:
        torch.set_num_threads(threads)
    table.save(output_path(args.profile, "--profile"))
    print(f"wrote {args.profile}: {table.stages} stages, b in {table.b_grid.tolist()}, s in {table.s_grid.tolist()} "
          f"({table.source})")
    return 0
