"""Dynamic micro-batching (DynaPipe) against padding and packing: real 4-stage CPU runs and the paper's GPT setting.

Real runs. One job of 4 gloo ranks x 1 thread trains a dense GPT-style model (dim 128, 8 layers, 2 per stage) as
a 4-stage pipeline on a long-tailed length mix: the standard library cut into its top-level blocks
(`data.units: blocks`), each a sample of its natural length, pieces of at most the maximum length (median ~300
tokens, a quarter at the maximum at 2048). Three micro-batchings of the same global batches (`data.batch_size`
samples) train side by side in the same 4 processes, one step of each in turn (the order rotates every step),
so the load of the shared machine hits them alike:

  padding   the batch in its order, every micro-batch padded to the batch's longest sample, 1F1B; the
            micro-batch count searched on the cost model (the paper grid-searches its baseline's)
  packing   samples first-fit into rows of the maximum length (attention across the packed samples, as
            Megatron's packing), rows grouped into micro-batches (count searched likewise), 1F1B
  dynamic   DynaPipe: the DP split on the cost table, 1F1B or adaptive chosen per iteration by simulation,
            planned communication, plans made ahead in a background process

All three use the same measured cost table (profiled once, in this process, before the runs), the same
planned engine and the same per-token loss, so padding and dynamic compute the same losses (checked).
Reported per method and maximum length: padding efficiency (real / computed tokens), tokens/s (real tokens
over the steps after warm-up / their wall time; and the median of per-step ratios against the baselines,
each step being the same batch for every method), exposed planning (seconds each step waited for its
plan, max over ranks, summed over the measured steps, and its share of their wall time).

Simulated runs. The DynaPipe paper's 4-GPU GPT (Table 1: 16 layers, dim 4096, 3.35B) as a 4-stage pipeline
on A100s (the hardware-profile cost model, bf16), global batch 65,536 tokens of FLAN-like lengths
(log-normal, median 150, sigma 1.1; the extraction's synthetic stand-in for FLANv2), maximum length 512 to
8192: packing (1F1B, micro-batch count searched) against dynamic micro-batching, both simulated event by
event on the same cost model; the ratio is set next to the paper's "up to 3.25x" for GPT.

    python scripts/bench_microbatching.py [--quick] [--json FILE] [--png FILE] [--wait block|spin]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moebal.commands.bench import add_device_argument, at_least, script_device
from moebal.config import Config, from_dict, to_dict
from moebal.distributed.testing import run_ranks
from moebal.errors import ConfigError
from moebal.kernels.bench import environment

CPU_ONLY = "it times 4 gloo ranks of one thread each on this machine's cores"
"""Why `--device` accepts cpu only here."""

METHODS = ("padding", "packing", "dynamic")
PAPER_GPT_SPEEDUP = 3.25
LOSS_RTOL = 1e-6
"""Dynamic and padding train the same samples with the same per-token loss: their losses may differ only by the
order of the sums (measured 2e-8 to 4e-8 relative, docs/microbatching.md); a larger difference fails the run."""


def bench_config(max_len: int, batch: int, method: str, costs: str, wait: str, workers: int) -> Config:
    return from_dict({
        "name": f"bench-microbatching-{method}-{max_len}",
        "model": {"dim": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 512, "max_seq_len": max_len},
        "moe": {"num_experts": 0},
        "data": {"seq_len": max_len, "batch_size": batch, "samples": "documents", "units": "blocks",
                 "val_fraction": 0.0},
        "train": {"steps": 1000, "warmup_steps": 5, "lr": 1e-3, "seed": 0, "precision": "fp32", "eval_every": 0},
        "parallel": {"pp": 4, "nproc": 4},
        "pipeline": {"microbatching": method, "wait": wait,
                     "dynamic": {"costs": costs, "workers": workers, "lookahead": 2}}})


def _rank_main(rank: int, world: int, cfgs: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Every method side by side in these 4 processes, one step of each in turn (rotated)."""
    from moebal.config import from_dict as build
    from moebal.pipeline.planned import PlannedPipelineRunner

    runners = {}
    for name, c in cfgs.items():
        cfg = build(c)
        runners[name] = PlannedPipelineRunner(cfg)
        runners[name].start()
    names = list(runners)
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    try:
        for step in range(steps):
            k = step % len(names)
            for name in names[k:] + names[:k]:
                records[name].append(runners[name].train_step())
            load.append(os.getloadavg()[0])
    finally:
        for r in runners.values():
            r.close()
    return {"records": records, "load": load}


def summarise(results: list[dict[str, Any]], warmup: int, max_len: int) -> list[dict[str, Any]]:
    rank0 = results[0]["records"]
    out = []
    per_step = {m: [r["tokens"] / r["step_time_s"] for r in rank0[m][warmup:]] for m in rank0}
    for m, recs in rank0.items():
        win = recs[warmup:]
        wall = sum(r["step_time_s"] for r in win)
        exposed = sum(max(res["records"][m][warmup + i]["plan_wait_s"] for res in results) for i in range(len(win)))
        rec = {"kind": "real", "max_len": max_len, "method": m,
               "padding_efficiency": sum(r["tokens"] for r in win) / sum(r["computed_tokens"] for r in win),
               "tokens_per_s": sum(r["tokens"] for r in win) / wall,
               "tokens_per_s_median_step": statistics.median(per_step[m]),
               "planning_exposed_s": exposed, "planning_exposed_share": exposed / wall,
               "plan_s_median": statistics.median(r["plan_s"] for r in win),
               "step_time_median_s": statistics.median(r["step_time_s"] for r in win),
               "micro_batches_mean": statistics.mean(r["micro_batches"] for r in win),
               "schedules": {s: sum(r["schedule"] == s for r in win) for s in sorted({r["schedule"] for r in win})},
               "steps_measured": len(win), "tokens_per_step_mean": statistics.mean(r["tokens"] for r in win),
               "bubble_ratio_median": statistics.median(r["bubble_ratio"] for r in win),
               "losses": [r["loss"] for r in recs],
               # every measured step, in order: the totals and medians above can be re-derived from them
               "step_times_s": [r["step_time_s"] for r in win], "step_tokens": [r["tokens"] for r in win],
               "load_avg": [round(x, 2) for x in results[0]["load"]]}
        for base in ("padding", "packing"):
            if base in per_step and base != m:
                ratios = [a / b for a, b in zip(per_step[m], per_step[base])]
                rec[f"speedup_vs_{base}"] = rec["tokens_per_s"] / (sum(r["tokens"] for r in rank0[base][warmup:])
                                                                  / sum(r["step_time_s"] for r in rank0[base][warmup:]))
                rec[f"speedup_vs_{base}_median_step"] = statistics.median(ratios)
        out.append(rec)
    return out


# ---- the paper's GPT setting, simulated --------------------------------------------------------------------
def materialised_attention(cost: Any, shape: Any, sizes: list[int], profile: str = "a100",
                           dtype: str = "bf16") -> Any:
    """The same table with attention as Megatron's fused-softmax path instead of a flash kernel: the full s x s
    square of both GEMMs per head (no causal skip), the scores written, scaled-masked-softmaxed and read back
    (4 passes over b a s^2 elements forward, twice that backward), and Korthikanti et al.'s 5 a s^2 bytes per
    sample and layer kept for the backward (scores, softmax output, dropout mask)."""
    from dataclasses import replace

    from moebal.planner.cost import CostModel

    cm = CostModel(profile, dtype)
    p = cm.profile
    a, hd = shape.n_heads, shape.head_dim
    fwd, bwd, act = cost.fwd_PBS.copy(), cost.bwd_PBS.copy(), cost.act_PBS.copy()
    for ib, b in enumerate(cost.b_grid.tolist()):
        for js, s in enumerate(cost.s_grid.tolist()):
            # one batched kernel over rows and heads: a launch once, not per (row, head)
            one = float(cm.gemm_s(s, s, hd, efficiency=p.attention_efficiency)) - p.gemm.launch_s
            square = 2 * one * b * a
            scores = b * a * s * s * cm.act_bytes
            extra_f = (1.0 - p.causal_attention_factor) * square + float(cm.mem_s(4.0 * scores))
            extra_b = (1.0 - p.causal_attention_factor) * 2 * square \
                + float(cm.mem_s(8.0 * scores))
            for st, n in enumerate(sizes):
                fwd[st, ib, js] += n * extra_f
                bwd[st, ib, js] += n * extra_b
                act[st, ib, js] += n * 5.0 * a * s * s * b
    return replace(cost, fwd_PBS=fwd, bwd_PBS=bwd, act_PBS=act, source=cost.source + "+materialised-attention")


def with_recomputation(cost: Any, budget: float, dim: int, sizes: list[int]) -> Any:
    """Full activation recomputation where a micro-batch's stored activations, times the P micro-batches 1F1B
    keeps in flight on the first stage, exceed the budget: the backward reruns the forward, and only each
    layer's input (b s D bf16) is kept."""
    from dataclasses import replace

    P = len(sizes)
    bwd, act = cost.bwd_PBS.copy(), cost.act_PBS.copy()
    for ib, b in enumerate(cost.b_grid.tolist()):
        for js, s in enumerate(cost.s_grid.tolist()):
            if np.nanmax(cost.act_PBS[:, ib, js]) * P > budget:
                bwd[:, ib, js] += cost.fwd_PBS[:, ib, js]
                act[:, ib, js] = np.asarray(sizes, dtype=float) * b * s * dim * 2
    return replace(cost, bwd_PBS=bwd, act_PBS=act, source=cost.source + "+recomputation")


# A100 40 GB: model states of a quarter of 3.35B parameters in mixed-precision Adam (16 bytes each) leave ~26.6
# GB; 10 % is kept back for the allocator and workspaces
A100_ACTIVATION_BUDGET = 0.9 * (40e9 - 16 * 3.35e9 / 4)
VARIANTS = ("flash attention", "materialised attention", "materialised attention + recomputation")


def simulated_gpt(lengths_max: list[int], seed: int = 0, batches: int = 3) -> list[dict[str, Any]]:
    out = []
    for variant in VARIANTS:
        out += _simulated_gpt(lengths_max, variant, seed, batches)
    return out


def _simulated_gpt(lengths_max: list[int], variant: str, seed: int, batches: int) -> list[dict[str, Any]]:
    from moebal.commands.plan_microbatches import _paper_gpt
    from moebal.planner.microbatch import plan_microbatches
    from moebal.planner.microbatch_cost import analytic_table, default_grid

    shape = _paper_gpt()
    # The first two variants set no memory limit (activations as if they fit: large packed micro-batches, fewer
    # bubbles, no recomputation; it favours the baseline); the third holds both methods to the A100's budget,
    # recomputing where a micro-batch would not fit (the paper grid-searches its baseline's checkpointing).
    memory = A100_ACTIVATION_BUDGET if "recomputation" in variant else None
    out = []
    for max_len in lengths_max:
        b, s = default_grid(max_len, 65536)
        cost = analytic_table(shape, "a100", [4, 4, 4, 4], b, s, "bf16")
        if variant.startswith("materialised attention"):
            cost = materialised_attention(cost, shape, [4, 4, 4, 4])
        if memory is not None:
            cost = with_recomputation(cost, memory, shape.dim, [4, 4, 4, 4])
        times: dict[str, list[float]] = {"packing": [], "dynamic": []}
        eff: dict[str, list[float]] = {"packing": [], "dynamic": []}
        plan_s: list[float] = []
        tokens: list[int] = []
        for k in range(batches):
            rng = np.random.default_rng([seed, k])
            L = np.clip(rng.lognormal(np.log(150), 1.1, 4000), 4, max_len).astype(int)
            L = L[np.cumsum(L) <= 65536]
            tokens.append(int(L.sum()))
            for m in times:
                p = plan_microbatches(L, cost, method=m, memory=memory, max_len=max_len)
                times[m].append(p.predicted_time_s)
                eff[m].append(p.padding_efficiency)
                if m == "dynamic":
                    plan_s.append(p.meta["plan_s"])
        pack, dyn = float(np.mean(times["packing"])), float(np.mean(times["dynamic"]))
        for m, t in (("packing", pack), ("dynamic", dyn)):
            out.append({"kind": "simulated", "setting": "DynaPipe GPT 3.35B, 4-stage pipeline on A100 (cost model)",
                        "attention": variant, "max_len": max_len, "method": m,
                        "padding_efficiency": float(np.mean(eff[m])),
                        "iteration_s": t, "tokens_per_s": float(np.mean(tokens)) / t,
                        "planning_exposed_s": 0.0, "plan_s_mean": float(np.mean(plan_s)) if m == "dynamic" else 0.0,
                        "speedup_vs_packing": pack / t, "paper_speedup_vs_packing": PAPER_GPT_SPEEDUP})
    return out


# ---- figure ---------------------------------------------------------------------------------------------------
def write_png(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = [r for r in records if r["kind"] == "real"]
    sim = [r for r in records if r["kind"] == "simulated"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    lens = sorted({r["max_len"] for r in real})
    colors = {"padding": "#999999", "packing": "#4c72b0", "dynamic": "#dd8452"}
    w = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        rows = {r["max_len"]: r for r in real if r["method"] == m}
        x = np.arange(len(lens)) + (i - 1) * w
        axes[0].bar(x, [rows[L]["tokens_per_s"] if L in rows else 0 for L in lens], w, label=m, color=colors[m])
        axes[1].bar(x, [rows[L]["padding_efficiency"] if L in rows else 0 for L in lens], w, label=m, color=colors[m])
    for ax, title in ((axes[0], "real tokens/s (4 ranks, 2 shared cores)"), (axes[1], "padding efficiency")):
        ax.set_xticks(np.arange(len(lens)), [f"max {L}" for L in lens])
        ax.set_title(title)
        ax.legend()
    if sim:
        slens = sorted({r["max_len"] for r in sim})
        for variant, style in zip(VARIANTS, ("o-", "s--", "^:")):
            sp = [next(r["speedup_vs_packing"] for r in sim if r["max_len"] == L and r["method"] == "dynamic"
                       and r["attention"] == variant) for L in slens]
            axes[2].plot(slens, sp, style, color=colors["dynamic"], label=f"dynamic / packing, {variant}")
        axes[2].axhline(PAPER_GPT_SPEEDUP, ls="--", color="k", label="paper: up to 3.25x (GPT)")
        axes[2].axhspan(0.75 * PAPER_GPT_SPEEDUP, 1.25 * PAPER_GPT_SPEEDUP, color="k", alpha=0.06)
        axes[2].set_xscale("log", base=2)
        axes[2].set_ylim(0.8, 4.2)
        axes[2].set_xlabel("maximum sequence length")
        axes[2].set_ylabel("simulated speed-up over packing")
        axes[2].set_title("GPT 3.35B, 4 x A100, 65,536 tokens/batch")
        axes[2].legend(loc="upper left", fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shorter maximum length, fewer steps")
    ap.add_argument("--json", help="write the list of records here")
    ap.add_argument("--png", help="figure (default: next to --json, else bench-microbatching.png)")
    ap.add_argument("--wait", default="block", choices=["block", "spin"], help="pipeline receive waits")
    ap.add_argument("--steps", type=at_least(1), help="measured steps per method (after warm-up)")
    ap.add_argument("--lengths", help="maximum lengths, comma list (default 512,2048; quick: 1024)")
    ap.add_argument("--batch", type=at_least(1), default=32, help="samples per global batch (default 32)")
    ap.add_argument("--workers", type=at_least(0), default=1, help="background planning processes")
    ap.add_argument("--no-real", action="store_true", help="only the simulated GPT setting")
    ap.add_argument("--replot", metavar="JSON", help="redraw the figure from a records file and stop")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    if args.replot:
        png = Path(args.png) if args.png else Path(args.replot).with_suffix(".png")
        try:
            drawn = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            ap.error(f"--replot {args.replot}: cannot read its records ({type(e).__name__}: {e})")
        write_png(drawn, png)
        print(f"wrote {png}", file=sys.stderr)
        return 0
    try:
        lens = [int(x) for x in (args.lengths or ("1024" if args.quick else "512,2048")).split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        ap.error(f"--lengths: expected a comma list of positive maximum lengths; got {args.lengths!r}")
    for max_len in lens:  # every run's config, checked before anything is profiled or started
        for method in METHODS:
            try:
                bench_config(max_len, args.batch, method, "costs.json", args.wait, args.workers)
            except ConfigError as e:
                ap.error(f"the {method} run at maximum length {max_len} (--lengths, --batch, --workers): {e}")
    steps = args.steps or (6 if args.quick else 12)
    warmup = 2
    records: list[dict[str, Any]] = []
    cmd = [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
    env = {**environment(), "command": " ".join(cmd)}
    out_dir = Path(args.json).parent if args.json else Path("bench-results")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_real:
        import torch

        from moebal.pipeline.microbatch_profile import profile_table

        for max_len in lens:
            table = out_dir / f"microbatch-cost-{max_len}.json"
            cfg = bench_config(max_len, args.batch, "dynamic", str(table), args.wait, args.workers)
            t0 = time.perf_counter()
            torch.set_num_threads(1)
            profile_table(cfg, 4, max_len=max_len, max_tokens=4 * max_len, repeats=2).save(table)
            print(f"max {max_len}: cost table profiled in {time.perf_counter() - t0:.0f} s ({table})", file=sys.stderr)
            cfgs = {m: to_dict(bench_config(max_len, args.batch, m, str(table), args.wait, args.workers))
                    for m in METHODS}
            t0 = time.perf_counter()
            results = run_ranks(_rank_main, 4, cfgs, warmup + steps, timeout_s=3600)
            rows = summarise(results, warmup, max_len)
            for r in rows:
                r.update(wait=args.wait, batch=args.batch, env=env, wall_s=time.perf_counter() - t0)
            pad, dyn = (next(r for r in rows if r["method"] == m) for m in ("padding", "dynamic"))
            worst = max(abs(a - b) / abs(b) for a, b in zip(dyn["losses"], pad["losses"]))
            for r in rows:
                r["dynamic_vs_padding_loss_rel_diff"] = worst
                r["dynamic_vs_padding_losses_equal"] = worst <= LOSS_RTOL
            records += rows
            print(f"max {max_len}: {warmup + steps} interleaved steps of each method in {rows[0]['wall_s']:.0f} s",
                  file=sys.stderr)
            for r in rows:
                extra = "".join(f", {r[k]:.2f}x vs {k[len('speedup_vs_'):]}"
                                for k in ("speedup_vs_padding", "speedup_vs_packing") if k in r)
                print(f"  max {max_len:>5} {r['method']:<8} {r['tokens_per_s']:>8.0f} tok/s  eff "
                      f"{r['padding_efficiency']:.3f}  planning exposed {100 * r['planning_exposed_share']:.2f} %"
                      f"{extra}  (load {min(r['load_avg']):.1f}-{max(r['load_avg']):.1f})", file=sys.stderr)
            print(f"  losses dynamic vs padding: max relative difference {worst:.2e}", file=sys.stderr)
    sim = simulated_gpt([512, 1024, 2048, 4096, 8192] if not args.quick else [2048, 8192])
    for r in sim:
        r["env"] = env
    records += sim
    for r in sim:
        if r["method"] == "dynamic":
            print(f"  simulated GPT, {r['attention']:<22} max {r['max_len']:>5}: dynamic "
                  f"{r['speedup_vs_packing']:.2f}x packing "
                  f"(paper: up to {PAPER_GPT_SPEEDUP}x), efficiency {r['padding_efficiency']:.3f}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    png = Path(args.png) if args.png else (Path(args.json).with_suffix(".png") if args.json
                                           else Path("bench-microbatching.png"))
    write_png(records, png)
    print(f"wrote {args.json or '(no json)'} and {png}", file=sys.stderr)
    unequal = sorted({r["max_len"] for r in records if r.get("dynamic_vs_padding_losses_equal") is False})
    if unequal:
        print(f"bench_microbatching: FAILED: dynamic and padding losses differ by more than {LOSS_RTOL:g} "
              f"(relative) at maximum length {unequal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
