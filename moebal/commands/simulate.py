"""`moebal simulate`: one training iteration of a model on a modelled GPU cluster, in this process.

Example: moebal simulate mixtral-8x7b --cluster h100-ndr400 --ranks 1024 --policy prophet --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from moebal.config import refuse_flag_and_override
from moebal.errors import ConfigError
from moebal.fileio import output_path

DEFAULT_ZIPF = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="model YAML or preset name (mixtral-8x7b, llama-moe-3.5b); default: the embedded default run")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. moe.top_k=1")
    p.add_argument("--cluster", default="h100", help="hardware profile: short name (h100, h100-ndr400, a100, "
                   "rtx3090, rtx3090-nvlink, rtx2080ti) or a YAML path (see `moebal calibrate`)")
    p.add_argument("--ranks", type=int, default=None, help="GPUs in the job (default: pp x ep)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (default: parallel.pp)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: parallel.ep)")
    p.add_argument("--policy", choices=("static", "fastermoe", "prophet"), default="static",
                   help="expert placement: static EP (DeepSpeed-MoE), FasterMoE shadowing + smart schedule, "
                        "Pro-Prophet placement + block-wise Trans/Agg overlap")
    p.add_argument("--lina", action="store_true", help="Lina: all-reduce in 30 MB chunks, never while an "
                   "all-to-all is queued or running; all-to-all in 2 token chunks pipelined with the experts")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per iteration (default: the "
                   "config's, as `moebal plan memory` plans them: min(pipeline.micro_batches, rows per rank) with a "
                   "pipeline, train.grad_accum without)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch per data-parallel "
                   "rank (default: the config's rows per rank / micro-batches)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: data.seq_len)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
    p.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16"), default=None,
                   help="compute dtype (default: train.precision)")
    p.add_argument("--routing", default="synthetic", help="'synthetic' or a routing log / plans.jsonl to replay")
    p.add_argument("--zipf", type=float, default=DEFAULT_ZIPF, help="synthetic routing: Zipf exponent of expert "
                   "popularity (0 = uniform)")
    p.add_argument("--drift", type=float, default=0.05, help="synthetic routing: locality drift per step")
    p.add_argument("--seed", type=int, default=0, help="synthetic routing seed")
    p.add_argument("--step", type=int, default=None, help="which step to simulate (placements plan on the step "
                   "before; default 1, with a routing log its second logged step; a log's steps are the ones it "
                   "names)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (open in Perfetto)")
    p.add_argument("--trace-ranks", type=int, default=64, help="ranks in the trace (the first N; 0 = all)")


def run(args: argparse.Namespace) -> int:
    from moebal.interop.hf_config import load
    from moebal.planner.cost import CostModel, ModelShape
    from moebal.sim.simulate import plan_placements, simulate, write_chrome_trace

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # `moebal simulate moe.top_k=1`: an override, not a file
        config, overrides = None, [config, *overrides]
    refuse_flag_and_override(args, overrides, (("pp", "parallel.pp"), ("ep", "parallel.ep"),
                                               ("seq_len", "data.seq_len"), ("dtype", "train.precision")))
    cfg = load(config, overrides)
    shape = ModelShape.from_config(cfg)
    # a modelled cluster's GPUs compute bf16 natively: that is what precision auto means there
    cost = CostModel(args.cluster, args.dtype or cfg.train.precision.replace("auto", "bf16"))
    spec = _spec(cfg, shape, args)
    counts, predicted = _routing(args, shape, spec)
    opts: dict[str, Any] = {"overlap": True} if args.policy == "prophet" else {}
    if cfg.planner.max_replicas is not None:
        opts["max_replicas"] = cfg.planner.max_replicas
    stages = spec.stage_layers or _stages(shape, spec)
    placements = None
    if predicted is not None:
        placements = plan_placements(args.policy, cost, shape, spec, predicted, stages, **opts)
    res = simulate(shape, cost, spec, counts, placements)
    out = res.to_dict()
    out["config"] = cfg.name
    out["policy"] = args.policy
    out["memory"] = _memory(cfg, spec, args)
    if args.trace:
        n = args.trace_ranks or spec.layout.ranks
        assert res.engine is not None
        out["trace_events"] = write_chrome_trace(res.engine, output_path(args.trace, "--trace"),
                                                 range(min(n, spec.layout.ranks)))
        out["trace"] = args.trace
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print(out)
    return 0


def _memory(cfg: Any, spec: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The memory plan of the simulated layout (moebal/planner/memory.py): per-rank peak by term, the verdict."""
    from moebal.config import with_overrides
    from moebal.planner.hardware import load_profile
    from moebal.planner.memory import DeviceMemory, choose_shard, layout_from_config, plan_memory

    lay, m = spec.layout, spec.micro_batches
    stage_ranks = lay.ranks // lay.pp
    rows = spec.micro_batch_size * stage_ranks * m  # pp 1: m micro-batches are gradient accumulation
    try:
        run = with_overrides(cfg, [f"data.batch_size={rows}", f"data.seq_len={spec.seq_len}"])
        dtype = args.dtype or cfg.train.precision.replace("auto", "bf16")
        precision = "bf16" if dtype in ("bf16", "fp16") else "fp32"
        device = DeviceMemory.from_profile(load_profile(args.cluster), lay.ranks)
        changes: dict[str, Any] = {"pp": lay.pp, "ep": lay.ep, "micro_batches": m,
                                   "schedule": spec.schedule, "policy": args.policy}
        if run.parallel.shard == "auto":  # as `moebal train` would settle it on these ranks
            run, _ = choose_shard(run, lay.ranks, device, precision, **changes)
        plan = plan_memory(run, layout_from_config(run, lay.ranks, precision=precision, **changes), device)
    except ConfigError as e:
        return {"error": str(e)}
    return plan.to_dict()


def _stages(shape: Any, spec: Any) -> tuple[int, ...]:
    from moebal.sim.program import uniform_stages

    return uniform_stages(shape.n_layers, spec.layout.pp)


def _spec(cfg: Any, shape: Any, args: argparse.Namespace) -> Any:
    from moebal.config import tied_wire
    from moebal.sim.program import Layout, SimSpec

    for name, given in (("--ranks", args.ranks), ("--pp", args.pp), ("--ep", args.ep),
                        ("--micro-batches", args.micro_batches), ("--seq-len", args.seq_len)):
        if given is not None and given < 1:  # 0 is falsy: it would silently fall back to the default below
            raise ConfigError(f"{name} must be >= 1; got {given}")
    pp = args.pp or cfg.parallel.pp
    if args.ranks and args.ranks % pp:  # before a null ep is derived from ranks // pp
        raise ConfigError(f"{args.ranks} ranks cannot form {pp} pipeline stages: choose --ranks a multiple of {pp}")
    ep = args.ep or cfg.parallel.ep
    if ep is None:  # the config's null: every rank of a stage (capped at one expert per rank)
        E = max(shape.num_experts, 1)
        ep = min(E, args.ranks // pp) if args.ranks else E
        if shape.num_experts and (E % ep or (args.ranks and (args.ranks // pp) % ep)):
            raise ConfigError(f"parallel.ep is null and {args.ranks} ranks / {pp} stages do not split "
                              f"{E} experts evenly: give --ep (a divisor of {E})")
    if shape.num_experts and shape.num_experts % ep:
        source = "--ep" if args.ep else "parallel.ep"
        raise ConfigError(f"{source} {ep} does not divide the model's {shape.num_experts} experts: choose one of "
                          f"{[d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]}")
    ranks = args.ranks or pp * ep
    for name, v in (("--ranks", ranks), ("--pp", pp), ("--ep", ep), ("--micro-batch-size", args.micro_batch_size)):
        if v is not None and v < 1:
            raise ConfigError(f"{name} must be >= 1; got {v}")
    if args.trace_ranks < 0:
        raise ConfigError(f"--trace-ranks must be >= 0 (0: every rank); got {args.trace_ranks}")
    m, rows = _micro_batching(cfg, pp, args)
    lina: dict[str, Any] = (dict(lina_priority=True, ar_chunk_bytes=30e6, moe_schedule="lina", a2a_chunks=2)
                            if args.lina else {})
    # FasterMoE's policy keeps its own MoE schedule; --lina's priority and chunking still apply to it
    lina_schedule = lina.pop("moe_schedule", "serial")
    moe_schedule = "fastermoe" if args.policy == "fastermoe" else lina_schedule
    return SimSpec(layout=Layout(ranks, pp=pp, ep=ep), micro_batches=m, micro_batch_size=rows,
                   seq_len=args.seq_len or cfg.data.seq_len, schedule=args.schedule, moe_schedule=moe_schedule,
                   trans_overlap=args.policy == "prophet", grad_bytes=4, recompute=cfg.train.recompute,
                   tie_weight_bytes=2 if tied_wire(cfg.parallel) == "bf16" else 4, **lina)  # bf16 compute copies


def _micro_batching(cfg: Any, pp: int, args: argparse.Namespace) -> tuple[int, int]:
    """(micro-batches, rows per micro-batch per data-parallel rank). Each simulated rank runs the rows a rank of the
    config's own job runs (weak scaling: the global batch grows with --ranks): that job is the ranks `moebal plan
    memory` plans without --ranks (parallel.nproc, at least parallel.pp x parallel.ep), a stage of it shares
    data.batch_size, and its rows go through min(pipeline.micro_batches, rows) micro-batches with a pipeline,
    train.grad_accum without; --micro-batches and --micro-batch-size replace either."""
    from moebal.config import pipelined

    own_pp = cfg.parallel.pp
    own_ranks = max(cfg.parallel.nproc or 1, own_pp * (cfg.parallel.ep or 1))
    stage = own_ranks // own_pp
    if cfg.data.batch_size % stage:
        rows = None  # the config itself cannot run on its own ranks: no default to take
    else:
        rows = cfg.data.batch_size // stage
    m = args.micro_batches
    if m is None:
        staged = pipelined(pp, cfg.dynamism.scheme)
        m = min(cfg.pipeline.micro_batches if staged else cfg.train.grad_accum, rows or 1)
    b = args.micro_batch_size
    if b is None:
        if rows is None:
            raise ConfigError(f"data.batch_size {cfg.data.batch_size} does not split over the {stage} ranks of a "
                              f"stage of the config's own job: give --micro-batch-size (rows per micro-batch per "
                              f"rank) and --micro-batches")
        if rows % m:
            raise ConfigError(f"the config's {rows} rows per rank do not split into {m} micro-batches: give "
                              f"--micro-batch-size (rows per micro-batch per rank) or --micro-batches a divisor of "
                              f"{rows}")
        b = rows // m
    return m, b


def _routing(args: argparse.Namespace, shape: Any, spec: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    from moebal.sim.routing import LoggedRouting, SyntheticRouting

    if shape.num_experts == 0:
        return None, None
    lay = spec.layout
    tokens = spec.micro_batches * spec.micro_batch_size * spec.seq_len
    if args.step is not None and args.step < 1 and args.routing == "synthetic":
        raise ConfigError(f"--step must be >= 1 (placements plan on the previous step); got {args.step}")
    if args.routing == "synthetic":
        step = 1 if args.step is None else args.step
        if not (math.isfinite(args.zipf) and math.isfinite(args.drift) and args.zipf >= 0 and args.drift >= 0):
            raise ConfigError(f"--zipf (the popularity skew, 0 uniform) and --drift (the popularity logits' "
                              f"random-walk step) must be >= 0; got {args.zipf}, {args.drift}")
        src = SyntheticRouting(num_layers=shape.n_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                               zipf_s=args.zipf, drift=args.drift, seed=args.seed)
        return src.counts(step, lay.groups, lay.ep, tokens), src.counts(step - 1, lay.groups, lay.ep, tokens)
    log = LoggedRouting.from_file(args.routing)
    if log.num_experts != shape.num_experts:
        raise ConfigError(f"routing log {args.routing} has {log.num_experts} experts but the model has "
                          f"{shape.num_experts}: replay it with a matching config (moe.num_experts)")
    moe_layers = [i for i in range(shape.n_layers) if shape.is_moe(i)]

    def full(step: int) -> np.ndarray:
        c = log.counts(step, len(moe_layers), lay.groups, lay.ep, tokens, shape.top_k)
        out = np.zeros((shape.n_layers, *c.shape[1:]))
        out[moe_layers] = c
        return out

    step = log.first_replayable() if args.step is None else args.step
    if log.step_ids is None and step < 1:
        raise ConfigError(f"--step must be >= 1 (placements plan on the previous step); got {step}")
    return full(step), full(log.previous(step))


def _print(out: dict[str, Any]) -> None:
    m = out["meta"]
    print(f"{out['config']} on {m['ranks']} x {m['profile']} ({m['dtype']}): pp={m['pp']} dp={m['dp']} ep={m['ep']}, "
          f"{m['micro_batches']} micro-batches x {m['micro_batch_size']} x {m['seq_len']} tokens, "
          f"{m['schedule']}, policy {out['policy']}")
    print(f"  iteration time   {out['iteration_time_s'] * 1e3:10.2f} ms")
    print(f"  bubble ratio     {out['bubble_ratio']:10.3f}  (idle share of compute streams)")
    b, i = out["busy_s"], out["idle_s"]
    print(f"  busy per rank    {b['mean'] * 1e3:10.2f} ms (min {b['min'] * 1e3:.2f}, max {b['max'] * 1e3:.2f})")
    print(f"  idle per rank    {i['mean'] * 1e3:10.2f} ms (min {i['min'] * 1e3:.2f}, max {i['max'] * 1e3:.2f})")
    for k, v in out["comm_s"].items():
        print(f"  {k:<16} {v * 1e3:10.2f} ms per rank (time inside the ops, overlapped or not)")
    for k, v in out["bytes_by_link_class"].items():
        if v:
            print(f"  bytes {k:<10} {v / 1e9:10.3f} GB")
    print(f"  expert replicas  {out['placements'].get('replicas', 0):10d}")
    mem = out["memory"]
    if "error" in mem:
        print(f"  memory plan      n/a ({mem['error']})")
    else:
        t = mem["terms"]
        top = sorted((k for k in t if k not in ("runtime", "allocator slack")), key=lambda k: -t[k])[:3]
        print(f"  memory per rank  {mem['peak_bytes'] / 1e9:10.2f} GB of {mem['capacity_bytes'] / 1e9:.1f} GB: "
              f"{'fits' if mem['fits'] else 'does NOT fit'} (shard {mem['layout']['shard']}, recompute "
              f"{mem['layout']['recompute']}; largest: " + ", ".join(f"{k} {t[k] / 1e9:.1f} GB" for k in top)
              + "; `moebal plan memory`)")
    if "trace" in out:
        print(f"  trace            {out['trace']} ({out['trace_events']} events)")
    print(f"  simulated in {out['simulate_wall_s']:.2f} s")
