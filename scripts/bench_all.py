"""Refresh every README Results row with one command: run each row's benchmark, write one JSON and one table.

    python scripts/bench_all.py --quick|--full [--json FILE] [--table FILE] [--only NAME,...] [--resume FILE]
    [--dry-run]

Every row of the README's Results table names a command; `ROWS` below holds one entry per row (its claim,
the run behind it, and how its figure is read from that run's JSON). Rows that share a command share one run
(`RUNS`). Each run is its own subprocess from the repository root, with `--json` into a temporary folder (or
`--json` to stdout for the `moebal` subcommands that print their JSON), and a per-run timeout. `--full` runs
each command as the README names it; `--quick` runs each run's quick form (`Run.quick`: mostly the script's own
`--quick`, without the README's options that would override it; bench_sparse_attention, which has none, at
`--seq 512 --repeats 3`, a figure that is then not the README's 2,048-token claim); a command without a quick
form runs as in `--full`. A run that
fails or times out is recorded as failed with its message and the others go on. Test rows (`pytest`) run the
tests; their figure is the pytest summary line. GPU-only runs are skipped with the reason when torch sees no
CUDA device.

Outputs: the JSON (per run: command, exit status, wall time, the script's own JSON; per row: the claim, the
figure, the run) and a markdown table (claim, figure, machine, command), both to stdout's summary and to
`--json` / `--table` when given. No figure is written by hand: each comes from a JSON the run produced, and
where that JSON lacks what a row needs the figure says "n/a (reason)".

`--only NAME,...` picks runs by name (`--dry-run` lists them). The JSON and the table are rewritten after every
run (`"complete": false` until the last, and while any run of the registry is missing from the report: `"missing"`
lists them), so a long `--full` run that is stopped keeps what finished;
`--resume FILE` reads such a JSON back, keeps its runs that succeeded (in the same mode) and runs the rest (with
`--only`, the chosen ones of the rest; the kept runs stay in the report either way).
Each run records the commit it ran (`git rev-parse HEAD`, "+dirty" with local changes), when it started and the
host's 1-minute load average at its start and end, so a reader can tell a quiet run from a loaded one and a
resumed report says which code each figure came from. Tests and other callers can pass their own registry to
`main(argv, runs=..., rows=...)`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebal.fileio import write_text_whole

ROOT = Path(__file__).resolve().parents[1]
TAIL_CHARS = 4000  # of a run's stdout / stderr kept in the JSON


def _tail(text: str) -> str:
    """The end of a run's output as the report keeps it: the repository's own path written `<repo>` (pytest prints
    its rootdir), so a report committed to docs/bench-runs/ names no machine's folders."""
    return text.replace(str(ROOT), "<repo>")[-TAIL_CHARS:]


@dataclass(frozen=True)
class Run:
    """One command behind one or more README rows.

    `argv` is the command as the README names it (words; "python" and "moebal" are run with this
    interpreter). `quick` replaces it under `--quick` (None: the same command). `json` says how the run hands
    back its JSON: "file" (`--json PATH` appended), "stdout" (`--json` appended, stdout parsed), "none" (a
    test run: bench_all records its summary line). `prepare` writes input files into the run's folder and
    returns extra arguments.
    """

    name: str
    argv: tuple[str, ...]
    quick: tuple[str, ...] | None = None
    json: str = "file"
    gpu: bool = False
    timeout_s: float = 3600.0
    prepare: Callable[[Path], list[str]] | None = None


@dataclass(frozen=True)
class Row:
    """One README Results row: its claim, the run it comes from, and the figure read from that run's JSON."""

    claim: str
    run: str
    figure: Callable[[Any], str]
    basis: str = ""  # one line: what was fitted (and on which data) and what the figure predicts or measures
    target: str = ""  # the target for the figure, shown beside it ("" where the row has none)
    asserts: str = ""  # a test row: what its tests assert, shown before the pytest summary
    readme: bool = True  # False: `--render --readme` leaves the README cell (it holds more than this run gives)


# ---------------------------------------------------------------------------------------------------- figures

def _spread(values: Sequence[float], fmt: str = "{:.3f}x") -> str:
    """median with min-max over the rounds (or just the value for one round)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no rounds in the JSON")
    med = fmt.format(statistics.median(vals))
    if len(vals) == 1:
        return f"{med} (1 round)"
    return f"median {med} (min {fmt.format(min(vals))}, max {fmt.format(max(vals))}, {len(vals)} rounds)"


def _records(data: Any) -> list[dict[str, Any]]:
    """The list of records of a script's JSON (a list, or a dict with `records`)."""
    recs = data.get("records") if isinstance(data, dict) else data
    if isinstance(recs, list):
        return [r for r in recs if isinstance(r, dict)]
    raise ValueError("the JSON holds no list of records")


def fig_layer(data: Any) -> str:
    """moebal's and the per-expert loop's forward+backward time over dense SwiGLU, per dtype and routing."""
    parts = []
    recs = [r for r in _records(data) if "ratio_to_dense" in r]
    for dtype in sorted({r["dtype"] for r in recs}):
        cells = []
        for method, label in (("moebal", "moebal"), ("loop", "per-expert loop")):
            got = {r["routing"]: r["ratio_to_dense"] for r in recs if r["dtype"] == dtype and r["method"] == method}
            if got:
                cells.append(f"{label} " + " / ".join(f"{got[k]:.2f}x {k}" for k in sorted(got)))
        parts.append(f"{dtype}: " + "; ".join(cells))
    if not parts:
        raise ValueError("no record with ratio_to_dense")
    return "; ".join(parts) + " (ratio to dense, median of repeats)"


def fig_expert_parallel(data: Any) -> str:
    """Each policy's step time over static placement, per routing: the median of the per-round ratios."""
    recs = _records(data)
    parts = []
    for ranks in sorted({r.get("ranks", r.get("world_size", 0)) for r in recs if "round_medians_s" in r}):
        here = [r for r in recs if r.get("ranks", r.get("world_size", 0)) == ranks and "round_medians_s" in r]
        for routing in sorted({r["routing"] for r in here}):
            static = next(r for r in here if r["routing"] == routing and r["policy"] == "static")
            cells = []
            for r in here:
                if r["routing"] != routing or r["policy"] == "static":
                    continue
                ratios = [a / b for a, b in zip(r["round_medians_s"], static["round_medians_s"])]
                cells.append(f"{r['policy']} {_spread(ratios)}")
            parts.append(f"{ranks} ranks {routing}: " + "; ".join(cells))
    if not parts:
        raise ValueError("no record with round_medians_s")
    return " | ".join(parts) + " (step time / static, per round)"


def fig_plan_latency(data: Any) -> str:
    """Pro-Prophet's planning time per size (median, min, max of the repeats)."""
    recs = [r for r in _records(data) if r.get("policy") == "prophet"]
    if not recs:
        raise ValueError("no prophet record")
    return "; ".join(f"{r['median_ms']:.2f} ms at {r['experts']} experts x {r['ranks']} ranks "
                     f"(min {r['min_ms']:.2f}, max {r['max_ms']:.2f})" for r in recs)


def fig_comm(data: Any) -> str:
    """Unscheduled over Lina (+ overlap): all-to-all time and step time, per world size."""
    recs = [r for r in _records(data) if r.get("kind") == "measured"]
    parts = []
    for world in sorted({r["world_size"] for r in recs}):
        by = {r["mode"]: r for r in recs if r["world_size"] == world}
        base = by["unscheduled"]
        cells = [f"{m}: step {base['step_time_median_s'] / by[m]['step_time_median_s']:.2f}x, all-to-all "
                 f"{base['a2a_time_s'] / by[m]['a2a_time_s']:.2f}x" for m in ("lina", "lina+overlap") if m in by]
        parts.append(f"{world} ranks " + "; ".join(cells))
    if not parts:
        raise ValueError("no measured record")
    return " | ".join(parts) + " lower than unscheduled (medians over steps)"


def fig_lina_inference(data: Any) -> str:
    """Static over Lina: the MoE layer's time per width and rank count, the CPU as it is and emulated devices."""
    if not isinstance(data, dict) or not data.get("by_width"):
        raise ValueError("the JSON has no by_width")
    parts, equal = [], True
    for width, rec in sorted(data["by_width"].items(), key=lambda kv: int(kv[0])):
        dilated = [(f"emulated {d}x", by) for d, by in rec.get("by_ranks_dilated", {}).items()]
        for device, by in [("CPU", rec["by_ranks"]), *dilated]:
            for ranks, summ in sorted(by.items(), key=lambda kv: int(kv[0])):
                experts = summ["static_over_lina_experts_layers_1_on"]
                parts.append(f"width {int(width):,}, {ranks} ranks, {device}: {summ['static_over_lina']:.2f}x "
                             f"(oracle {summ['static_over_oracle']:.2f}x; experts {experts:.2f}x)")
                equal = equal and all(summ[p]["equal_static"] for p in ("lina", "phase1", "oracle"))
    rounds = data["settings"]["rounds"]
    return ("static / Lina MoE time: " + "; ".join(parts) + f" (medians over {rounds} round{'s' * (rounds != 1)}, "
            f"policies rotated); every policy's outputs equal static's: {equal}")


def fig_pipeline_overlap(data: Any) -> str:
    """Block overlap off over on in pipeline stages: every round and the median."""
    summary = _pipeline_summary(data)
    rounds = ", ".join(f"{x:.3f}x" for x in summary["off_over_on_rounds"])
    return (f"step time without / with the overlap {rounds} (median {summary['off_over_on_median']:.3f}x); "
            f"losses equal: {summary['losses_equal']}")


def _pipeline_summary(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or "summary" not in data:
        raise ValueError("the JSON has no summary")
    summary: dict[str, Any] = data["summary"]
    return summary


def _overhead(summary: dict[str, Any]) -> str:
    ov = next(v for k, v in summary["targets"].items() if k.startswith("rebalancing overhead"))
    text = f"overhead every step worst {ov['measured']:.1%} (median {ov['median']:.1%})"
    after = summary.get("overhead_after_settle_excluding_first_migrations")
    if after:
        text += f"; after settle, first migrations left out: worst {after['worst']:.1%}"
    return text


def fig_pipeline(scheme: str) -> Callable[[Any], str]:
    """Every balancer's rebalanced / static throughput for `scheme` (median and spread of the per-round ratios).

    All balancers the run measured are listed, in the run's order: reporting only the better one would pick a
    variant after seeing the rounds."""

    def figure(data: Any) -> str:
        summary = _pipeline_summary(data)
        per_round = summary["speedup_per_round"]
        keys = [k for k in per_round if k.split("/")[1:2] == [scheme] and not k.startswith("block")]
        if not keys:
            raise ValueError(f"no speedup_per_round entry for {scheme}")
        text = "; ".join(f"{k}: {_spread(per_round[k])}" for k in keys) + " static throughput"
        halves = {k: v for k, v in summary.get("halves_over_layers", {}).items() if f"/{scheme}/" in k}
        if halves:
            text += "; halves / whole layers " + ", ".join(f"{k} {v:.3f}x" for k, v in halves.items())
        return f"{text}; {_overhead(summary)}; {_identical(summary.get('identical_losses_across_variants'))}"

    return figure


def fig_repack(data: Any) -> str:
    """Whether re-packing released a rank and its throughput against the unpacked run."""
    summary = _pipeline_summary(data)
    hits = {k: v for k, v in summary["targets"].items() if "re-pack" in k}
    if not hits:
        raise ValueError("no re-pack target in the summary")
    rows = [r for r in _records(data) if r.get("repack_experiment")]
    pair = {r["round"]: r["throughput"] for r in rows if not r["repack"]}
    ratios = [r["throughput"] / pair[r["round"]] for r in rows if r["repack"] and r["round"] in pair]
    released = sum(bool(r["released_ranks"]) for r in rows if r["repack"])
    v = next(iter(hits.values()))
    return (f"a rank released in {released} of {len(ratios)} rounds; packed / unpacked throughput "
            f"{_spread(ratios)}; met: {v['met']}")


def fig_zb(data: Any) -> str:
    """Zero bubble over 1F1B tokens/s per scheme and balancer, and whether losses matched."""
    summary = _pipeline_summary(data)
    zb = summary["zb_over_1f1b"]
    return ("zb / 1F1B " + ", ".join(f"{k} {v:.3f}x" for k, v in zb.items())
            + f"; {_identical(summary.get('identical_losses_across_variants'))}")


def fig_microbatching(data: Any) -> str:
    """DynaPipe's real runs: padding efficiency, speed over padding and packing, exposed planning share."""
    recs = [r for r in _records(data) if r.get("kind") == "real" and r.get("method") == "dynamic"]
    if not recs:
        raise ValueError("no real dynamic record")
    return "; ".join(f"max {r['max_len']}: padding efficiency {r['padding_efficiency']:.3f}, "
                     f"{r.get('speedup_vs_padding', float('nan')):.2f}x padding, "
                     f"{r.get('speedup_vs_packing', float('nan')):.2f}x packing tokens/s (per-step medians "
                     f"{r.get('speedup_vs_padding_median_step', float('nan')):.2f}x / "
                     f"{r.get('speedup_vs_packing_median_step', float('nan')):.2f}x), planning exposed "
                     f"{r['planning_exposed_share']:.2%}" for r in recs)


def fig_microbatching_sim(data: Any) -> str:
    """DynaPipe's simulated GPT 3.35B: speed over packing per attention variant and maximum length."""
    recs = [r for r in _records(data) if r.get("kind") == "simulated" and r.get("method") == "dynamic"]
    if not recs:
        raise ValueError("no simulated dynamic record")
    longest = max(r["max_len"] for r in recs)  # the row's claim: the longest sequences
    recs = [r for r in recs if r["max_len"] == longest]
    return ("; ".join(f"{r['attention']}: {r['speedup_vs_packing']:.2f}x packing" for r in recs)
            + f" at max {longest} (paper: up to {recs[0]['paper_speedup_vs_packing']}x)")


def fig_plan_microbatches(data: Any) -> str:
    """The dynamic plan's planning time and size."""
    plan = data["plans"]["dynamic"]
    return (f"{plan['plan_s']:.3f} s for {data['samples']} samples ({data['tokens']} tokens), "
            f"{plan['micro_batches']} micro-batches, padding efficiency {plan['padding_efficiency']:.3f}")


def fig_simulate(data: Any) -> str:
    """The simulated iteration time."""
    return (f"{data['iteration_time_s']:.2f} s per iteration on {data['num_ranks']} ranks "
            f"(policy {data.get('policy')}; other clusters and policies: not run by this row's command)")


def fig_validate(data: Any) -> str:
    """The simulator's out-of-sample error over every round of every step run: median, 90th percentile, rank
    correlation (the script's summary), and the same over the runs' medians."""
    s = data["summary"]["steps"]

    def pct(v: Any) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    def rho(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    return (f"out of sample, {s['runs']} step runs x {data['summary']['rounds']} rounds: median |error| "
            f"{pct(s['median_abs_error'])}, 90th percentile {pct(s['p90_abs_error'])}, rank correlation "
            f"{rho(s['spearman'])} (runs' medians: {pct(s['runs_median_abs_error'])}, {rho(s['runs_spearman'])}); "
            f"load {data['summary']['load_average_samples']}")


def fig_pro_prophet(data: Any) -> str:
    """Held-out error, within-25 % count, the constant baseline's error, and the verdict."""
    s = data["summary"]
    held = s["held_out"]
    base = "; ".join(f"constant {k}: {v['mean_abs_rel_error']:.1%}" for k, v in s.get("baselines", {}).items())
    return (f"held out: mean |error| {held['mean_abs_rel_error']:.1%}, {held['within_25pct']} within 25 %; "
            f"{base}; reproduced: {s['reproduced']}")


def fig_lina(data: Any) -> str:
    """Simulated and paper speed-ups of Lina's comparison."""
    rows = data["lina"]
    text = "; ".join(f"{r['experts']} experts {r['mode']} {r['simulated_speedup']:.2f}x (paper {r['paper_speedup']}x)"
                     for r in rows)
    verdict = data["summary"].get("assessment", {})
    if isinstance(verdict, dict) and "reproduced" in verdict:
        text += f"; reproduced: {verdict['reproduced']}"
    return text


def fig_convert(data: Any) -> str:
    """Peak extra memory of each conversion."""
    res = data["results"]
    return "; ".join(f"{op} {r['peak_extra_bytes'] / 1e6:.0f} MB" for op, r in res.items()) + \
        f" (checkpoint {data['checkpoint']['bytes'] / 1e9:.2f} GB)"


def fig_checkpoint(data: Any) -> str:
    """How long a save blocks training, per mode, and its share of 100 steps."""
    return "; ".join(f"{mode}: blocks {min(m['blocked_s']):.2f}-{max(m['blocked_s']):.2f} s, median "
                     f"{m['blocked_share_of_100_steps']:.2%} of 100 steps" for mode, m in data["modes"].items()) + \
        f" ({data['bytes_per_checkpoint'] / 1e6:.0f} MB per checkpoint)"


def fig_restart(data: Any) -> str:
    """Median recovery time per setting, and whether losses matched the uninterrupted run."""
    return "; ".join(f"{s}: {v['median_recovery_s']} s, losses equal {v['all_losses_equal']}"
                     for s, v in data["summary"].items())


def fig_train(data: Any) -> str:
    """The default run's steps, wall time, throughput, validation loss and load balance."""
    return (f"{data['steps']} steps in {data['wall_seconds']:.0f} s, {data['tokens_per_s']:.0f} tokens/s; "
            f"validation loss {data['val_loss']:.3f} = {data['val_ratio']:.3f}x the unigram entropy; "
            f"rank load max/mean per MoE layer {_floats(data['load_imbalance'])}"
            + (f"; stopped early: {data['stopped_early']}" if data.get("stopped_early") else ""))


def _floats(values: Sequence[float]) -> str:
    return ", ".join(f"{float(v):.2f}" for v in values) or "none"


def _identical(same: Any) -> str:
    """`identical_losses_across_variants` ({group: bool}) as "identical losses in k of n groups"."""
    if not isinstance(same, dict) or not same:
        return f"identical losses: {same}"
    differ = sorted(k for k, v in same.items() if not v)
    tail = f" (differ: {', '.join(differ)})" if differ else ""
    return f"identical losses in {len(same) - len(differ)} of {len(same)} groups{tail}"


def fig_gpu_check(data: Any) -> str:
    """Which of the GPU checks passed."""
    checks = {k: v for k, v in data.items() if isinstance(v, dict) and "ok" in v}
    passed = sorted(k for k, v in checks.items() if v["ok"])
    return f"{len(passed)} of {len(checks)} pass ({', '.join(passed)}); all ok: {data.get('ok')}"


def fig_memory(data: Any) -> str:
    """The memory plan's error against measured peaks: median and max over the validated layouts."""
    if data.get("median_abs_error") is None:
        raise ValueError("bench_memory validated no layout")
    return (f"median error {data['median_abs_error']:.1%}, max {data['max_abs_error']:.1%} over "
            f"{data['validated_rows']} layouts (per rank {data['median_abs_error_per_rank']:.1%})")


def fig_dynapipe(data: Any) -> str:
    """The DynaPipe reproduction's held-out error and verdict."""
    a = data["assessment"]
    h, base = a["held_out"], a["baselines"]["no_speedup_1x"]
    return (f"held-out mean error {h['mean_abs_rel_error']:.1%} ({h['within_25pct']} of {h['rows']} within 25 %; "
            f"1.0x baseline {base['mean_abs_rel_error']:.1%}); reproduced: {a['reproduced']}")


def fig_sparse_attention(data: Any) -> str:
    """The block-sparse kernel's time over dense at density 0.5, and the layer's measured against predicted."""
    t = data["target"]["sparse/dense at density 0.5 <= 0.6"]
    layer = next((r for r in data.get("layer", []) if r["density"] == 0.5), None)
    tail = f"; layer {layer['measured']:.2f}x measured vs {layer['predicted']:.2f}x predicted" if layer else ""
    return f"{t['measured']:.2f}x dense at density 0.5 (target 0.6x: {'met' if t['met'] else 'missed'}){tail}"


def fig_generate(data: Any) -> str:
    """Decode throughput with the KV cache over the whole-prefix forward, a batch over one prompt at a time, and
    multi-head latent attention's latent cache over its per-head one (bytes and speed)."""
    med, eq = data["median_tokens_per_s"], data["equal"]
    st = data["settings"]
    mla = data.get("mla_cache_bytes_per_position")
    latent = "" if mla is None else (
        f"; MLA's latent cache {mla['mla_per_head'] / mla['mla_latent']:.0f}x fewer bytes per position than its "
        f"per-head keys and values ({mla['mla_latent']:,} against {mla['mla_per_head']:,}) at "
        f"{data['mla_latent_over_per_head']:.2f}x their tokens/s")
    return (f"KV cache {med['cache']:.0f} against {med['no_cache']:.0f} tokens/s over the whole prefix "
            f"(**{data['cache_over_no_cache']:.2f}x**; {st['prompt_len']}-token prompt, {st['new']} new); "
            f"{len(st['prompts'])} prompts in one batch {med['batch']:.0f} against {med['one_by_one']:.0f} tokens/s "
            f"one at a time (**{data['batch_over_one_by_one']:.2f}x**){latent}; the same tokens both ways: "
            f"{all(eq.values())}")


def fig_pytest(data: Any) -> str:
    """The pytest summary line of a test row."""
    line = data.get("pytest_summary")
    if not line:
        raise ValueError("pytest printed no summary line")
    return str(line)


# --------------------------------------------------------------------------------------------------- registry

PIPE = ("python", "scripts/bench_pipeline_rebalance.py", "--wait", "dilate")
RUNS: tuple[Run, ...] = (
    Run("train", ("moebal", "train"), json="stdout", timeout_s=1800,
        prepare=lambda d: ["--out", str(d / "train-run")]),
    Run("gpu_check", ("python", "scripts/gpu_check.py"), ("python", "scripts/gpu_check.py", "--quick"), gpu=True),
    Run("layer_cuda", ("moebal", "bench", "layer", "--device", "cuda", "--dtypes", "bf16", "--tokens", "16384",
                       "--dim", "4096", "--ffn", "14336", "--kernels"),
        ("moebal", "bench", "layer", "--device", "cuda", "--dtypes", "bf16", "--quick", "--kernels"), gpu=True),
    Run("layer_cpu", ("python", "scripts/bench_moe_layer.py", "--repeats", "11"),
        ("python", "scripts/bench_moe_layer.py", "--quick")),
    Run("test_sync_budget", ("python", "-m", "pytest", "tests/unit/test_sync_budget.py",
                             "tests/distributed/test_expert_parallel.py"), json="none"),
    Run("test_expert_parallel", ("python", "-m", "pytest", "tests/distributed/test_expert_parallel.py"),
        json="none"),
    Run("expert_parallel", ("python", "scripts/bench_expert_parallel.py"),
        ("python", "scripts/bench_expert_parallel.py", "--quick")),
    Run("plan_latency", ("moebal", "plan", "experts", "--bench"), json="stdout"),
    Run("pipeline_overlap", ("python", "scripts/bench_pipeline_overlap.py"),
        ("python", "scripts/bench_pipeline_overlap.py", "--quick")),
    Run("comm_schedule", ("python", "scripts/bench_comm_schedule.py", "--dilate", "3"),
        ("python", "scripts/bench_comm_schedule.py", "--dilate", "3", "--quick")),
    Run("pipeline_exit_freezing", (*PIPE, "--schemes", "early_exit,freezing", "--units", "halves"),
        (*PIPE, "--schemes", "early_exit,freezing", "--units", "halves", "--quick"), timeout_s=7200),
    Run("pipeline_mod", (*PIPE, "--schemes", "mod", "--units", "halves", "--rounds", "3"),
        (*PIPE, "--schemes", "mod", "--units", "halves", "--quick"), timeout_s=7200),
    Run("pipeline_repack", (*PIPE, "--repack-only", "--rounds", "3"), (*PIPE, "--repack-only", "--quick"),
        timeout_s=7200),
    Run("pipeline_zb", (*PIPE, "--schemes", "freezing,mod", "--schedule", "both"),
        (*PIPE, "--schemes", "freezing,mod", "--schedule", "both", "--quick"), timeout_s=7200),
    Run("pipeline_sparse_attention", (*PIPE, "--schemes", "sparse_attention"),
        (*PIPE, "--schemes", "sparse_attention", "--quick"), timeout_s=7200),
    Run("microbatching", ("python", "scripts/bench_microbatching.py", "--steps", "10"),
        ("python", "scripts/bench_microbatching.py", "--quick")),
    Run("plan_microbatches", ("moebal", "plan", "microbatches", "--lengths", "FILE", "--stages", "4"),
        json="stdout", prepare=lambda d: _flan_lengths(d / "lengths.json")),
    Run("simulate", ("moebal", "simulate", "mixtral-8x7b", "--cluster", "h100", "--ranks", "1024"), json="stdout"),
    Run("validate_simulator", ("python", "scripts/validate_simulator.py"),
        ("python", "scripts/validate_simulator.py", "--quick"), timeout_s=3600),
    Run("reproduce_pro_prophet", ("python", "scripts/reproduce_pro_prophet.py")),
    Run("reproduce_lina", ("python", "scripts/reproduce_lina.py")),
    Run("test_hf", ("python", "-m", "pytest", "tests/unit/test_hf_interop.py", "tests/unit/test_hf_families.py",
                    "tests/unit/test_hf_deepseek.py"), json="none"),
    Run("convert", ("python", "scripts/bench_convert.py")),
    Run("checkpoint", ("python", "scripts/bench_checkpoint.py")),
    Run("test_resharding", ("python", "-m", "pytest", "tests/integration/test_resharding.py",
                            "tests/distributed/test_pipeline_resume.py"), json="none"),
    Run("test_rollback", ("python", "-m", "pytest", "tests/unit/test_spikes.py",
                          "tests/distributed/test_rollback.py"), json="none"),
    Run("restart", ("python", "scripts/bench_restart.py")),
    Run("memory", ("python", "scripts/bench_memory.py"), ("python", "scripts/bench_memory.py", "--quick"),
        timeout_s=7200),
    Run("test_sharded", ("python", "-m", "pytest", "tests/distributed/test_sharded.py"), json="none"),
    Run("test_recompute", ("python", "-m", "pytest", "tests/unit/test_recompute.py",
                           "tests/distributed/test_recompute.py", "tests/unit/test_local_init.py"), json="none"),
    Run("test_generate", ("python", "-m", "pytest", "tests/unit/test_generate.py",
                          "tests/integration/test_generate_cli.py", "tests/distributed/test_ep_generate.py",
                          "tests/unit/test_mod_predictor.py"),
        json="none"),
    Run("generate", ("python", "scripts/bench_generate.py"), ("python", "scripts/bench_generate.py", "--quick")),
    Run("test_lina_inference", ("python", "-m", "pytest", "tests/distributed/test_lina_inference.py"), json="none"),
    Run("lina_inference", ("python", "scripts/bench_lina_inference.py", "--ranks", "4", "--rounds", "10",
                           "--profile-batches", "8", "--dilate", "1", "3", "--width", "1024", "4096"),
        ("python", "scripts/bench_lina_inference.py", "--quick")),
    Run("test_fsdp", ("python", "-m", "pytest", "tests/distributed/test_fsdp.py"), json="none"),
    Run("test_plan_ahead", ("python", "-m", "pytest", "tests/distributed/test_plan_ahead.py"), json="none"),
    Run("reproduce_dynapipe", ("python", "scripts/reproduce_dynapipe.py"),
        ("python", "scripts/reproduce_dynapipe.py", "--quick")),
    Run("sparse_attention", ("python", "scripts/bench_sparse_attention.py", "--layer"),
        ("python", "scripts/bench_sparse_attention.py", "--layer", "--seq", "512", "--repeats", "3")),
)

MEASURED = "measured side by side in one run; nothing fitted"
MEASURED_RUN = "measured; nothing fitted"
TEST = "a test's assertion; nothing fitted"
PIPELINE = "measured, variants in turn (order rotated every step); layer costs measured in the run, nothing fitted"

ROWS: tuple[Row, ...] = (
    Row("default run: validation loss within 5 minutes", "train", fig_train,
        MEASURED_RUN, target="0.65x the unigram entropy within 5 minutes"),
    Row("GPU check: NCCL smoke, kernel parity, host syncs, bitwise resume, recompute, memory plan, gradient "
        "accumulation, sparse attention", "gpu_check", fig_gpu_check,
        "measured on the GPU; the memory plan's allocator slack (0.12) is fitted on an earlier run of the same 5 "
        "layouts, so its 4.6 % is in sample (no held-out GPU layout yet)",
        target="expert kernel 1.15x / 1.3x dense, balanced / skewed; full recompute 0.35x activations at 1.4x step"),
    Row("MoE layer fwd+bwd vs dense SwiGLU (bf16, 16,384 tokens, d 4096, 8 experts)", "layer_cuda", fig_layer,
        MEASURED, target="1.15x balanced, 1.3x skewed"),
    Row("MoE layer vs dense SwiGLU on CPU (2048 tokens, d 512)", "layer_cpu", fig_layer,
        MEASURED, target="1.15x balanced, 1.3x skewed"),
    Row("host syncs of the MoE path", "test_sync_budget", fig_pytest,
        TEST, asserts="host syncs per MoE layer counted through moebal.sync: 0 forward, 0 backward; expert "
        "parallel within its budget (docs/gpu.md)"),
    Row("expert parallelism = one process", "test_expert_parallel", fig_pytest,
        TEST, asserts="losses and gradients of 2 and 4 gloo ranks within 1e-5 of the single-process model"),
    Row("Pro-Prophet step time, 2 and 4 ranks (busiest expert 4x the mean)", "expert_parallel", fig_expert_parallel,
        "measured, policies rotated each round; the planner's cost model is probed live on the same ranks, "
        "not fitted to these figures", target="prophet+feedback within 3 % of static on balanced routing"),
    Row("planner latency (Pro-Prophet search)", "plan_latency", fig_plan_latency,
        MEASURED),
    Row("Lina scheduling + block overlap on real ranks (emulated devices, `--dilate 3`)", "comm_schedule", fig_comm,
        "measured on devices emulated 3x slower than a core (compute and link dilated); nothing fitted",
        target="all-to-all 1.3x lower, step 1.1x"),
    Row("block overlap inside pipeline stages (2 stages x 2 expert shards, emulated devices, 1 Gbit/s link)",
        "pipeline_overlap", fig_pipeline_overlap,
        "measured side by side in one job on devices emulated 3x slower than a core; nothing fitted"),
    Row("pipeline rebalancing, early exit (4 stages, dilate 3)", "pipeline_exit_freezing", fig_pipeline("early_exit"),
        PIPELINE),
    Row("pipeline rebalancing, freezing", "pipeline_exit_freezing", fig_pipeline("freezing"),
        PIPELINE),
    Row("pipeline rebalancing, Mixture-of-Depths (layer halves as units)", "pipeline_mod", fig_pipeline("mod"),
        PIPELINE, target="1.1x"),
    Row("pipeline rebalancing, dynamic sparse attention (per-layer block densities a bounded random walk that "
        "follows depth)",
        "pipeline_sparse_attention", fig_pipeline("sparse_attention"),
        PIPELINE, target="1.15x"),
    Row("re-pack onto fewer ranks (early exit leaving 28 % of the work)", "pipeline_repack", fig_repack,
        PIPELINE, target="a rank released within 10 % of the unpacked throughput"),
    Row("zero bubble (`pipeline.schedule: zb`) vs 1F1B", "pipeline_zb", fig_zb,
        MEASURED),
    Row("DynaPipe micro-batching, 4 stages, lengths up to 2048", "microbatching", fig_microbatching,
        MEASURED),
    Row("DynaPipe GPT 3.35B on 4 A100s, simulated, 8,192 tokens", "microbatching", fig_microbatching_sim,
        "predicted by the simulator on the a100 profile (datasheet peaks, assumed efficiencies); nothing fitted"),
    Row("DynaPipe GPT speed-ups predicted from Fig. 4's packing bound", "reproduce_dynapipe", fig_dynapipe,
        "fitted: one choice (attention pricing) on Fig. 4's packing bound; predicted: the headline and Fig. 16b"),
    Row("micro-batch plan time", "plan_microbatches", fig_plan_microbatches,
        MEASURED_RUN),
    Row("1,024-rank Mixtral-8x7B iteration, simulated on H100s (`configs/hardware/h100.yaml`)", "simulate",
        fig_simulate,
        "predicted from datasheet peaks and stated efficiency assumptions (configs/hardware/h100.yaml); its memory "
        "figures take the allocator slack (0.12) fitted on an H200's runs, nothing else fitted; no 1,024-GPU run "
        "to compare",
        # the README cell also gives the Pro-Prophet and h100-ndr400 figures of the same command's variants,
        # which tests/integration/test_simulate_cli.py checks against the command
        readme=False),
    Row("simulator vs measured moebal runs", "validate_simulator", fig_validate,
        "fitted: the CPU profile and the EP per-pass overhead, on calibration probes sharing no shape with the runs; "
        "predicted: the 24 runs", target="median 15 %, rank correlation 0.9"),
    Row("Pro-Prophet Table V predicted from Table IV", "reproduce_pro_prophet", fig_pro_prophet,
        "fitted: the baseline's all-to-all block sizing, on Table IV only; predicted: Table V",
        target="beat a per-column constant on the held-out rows"),
    Row("Lina Fig. 4.10 on 2-16 A100s", "reproduce_lina", fig_lina,
        "fitted: four a100 figures, on the thesis's baseline times; predicted: every speed-up",
        target="the paper's speed-ups within 25 %"),
    Row("HF logits vs `transformers` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3; LLaMA-MoE v1)", "test_hf",
        fig_pytest,
        TEST, asserts="fp32 logits within 1e-4 of `transformers`; HF -> moebal -> HF round trips bit-identical; "
        "exports load back into `transformers`"),
    Row("streaming conversion of a 3.16 GB Mixtral-shaped checkpoint", "convert", fig_convert,
        MEASURED_RUN),
    Row("checkpoint save, default model, 2 ranks", "checkpoint", fig_checkpoint,
        MEASURED_RUN, target="10 % of 100 steps"),
    Row("resume under another layout", "test_resharding", fig_pytest,
        TEST, asserts="resumed under another layout (expert-parallel ranks, stages, pipeline to one process): "
        "losses within 1e-5 of one uninterrupted run, bitwise under the same layout"),
    Row("rollback after a loss spike (`train.spike.action: rollback`)", "test_rollback", fig_pytest,
        TEST, asserts="a real spike (weights x30) rolls back to the newest checkpoint and skips the batches since "
        "it: losses bitwise those of the checkpoint resumed past the same batches, in one process, under expert "
        "parallelism with Pro-Prophet replicas, in a 2-stage pipeline, with FSDP2 state, with expert weights "
        "sharded at rest, on 2 stages x 2 expert shards and on planned micro-batches"),
    Row("recovery after a killed rank (target < 1 min)", "restart", fig_restart,
        MEASURED_RUN),
    Row("memory plan vs measured peak memory per rank (4 gloo ranks, 80M-parameter MoE)", "memory", fig_memory,
        "fitted: the CPU runtime and slacks (the full-shard slack included), on calibration runs of another model; "
        "predicted: the 15 layouts", target="median 15 %"),
    Row("sharded optimizer state (`parallel.shard: optimizer`)", "test_sharded", fig_pytest,
        TEST, asserts="20 steps on 2 and 4 ranks (data and expert parallel, Pro-Prophet replicas): losses, "
        "gradient norms and parameters within 1e-5 of unsharded; resume across shard sizes"),
    Row("fully sharded state (`parallel.shard: full`)", "test_fsdp", fig_pytest,
        TEST, asserts="FSDP2 dense state and sharded expert state, 20 steps on 2 and 4 ranks: within 1e-5 of "
        "unsharded; resume 1 -> 2 -> 4 shards; the bf16 policy"),
    Row("activation recomputation and rank-local initialisation", "test_recompute", fig_pytest,
        TEST, asserts="recomputation bit-identical to none in fp32 (one process, expert parallel with replicas, "
        "2 stages, early exit's and MoD's token subsets); a rank's locally built tensors equal the full model's "
        "bit for bit"),
    Row("text generation (`moebal generate`): the KV-cached decoder", "test_generate", fig_pytest,
        TEST, asserts="cached logits within 1e-5 of the full forward (grouped-query attention, latent attention "
        "with its latent or per-head cache, a sliding window, q/k norms, tied embeddings); greedy tokens equal "
        "transformers' `generate` on Mixtral, Qwen2-MoE and DeepSeek-V3 checkpoints and on Mixtral's conversion; a "
        "scheme's run served through the scheme (early exit KV-cached with its exits, Mixture-of-Depths through its "
        "causal predictors); expert-parallel decoding on 2 gloo ranks gives one process's tokens under every Lina "
        "policy"),
    Row("text generation: decode throughput (default model, fp32, greedy)", "generate", fig_generate,
        "measured, modes rotated each round in one process; nothing fitted"),
    Row("Lina inference scheduling (`moebal eval --policy lina`)", "test_lina_inference", fig_pytest,
        TEST, asserts="every policy's outputs equal plain expert parallelism's and the single-process model's; "
        "skewed routing gets replicas (MoE layer timings: docs/expert-parallel.md)"),
    Row("Lina inference scheduling: MoE layer time against static expert parallelism (busiest expert 4x the mean, "
        "top-1)", "lina_inference", fig_lina_inference,
        "measured, policies rotated each round; width 1,024 is the benchmark's default, 4,096 a tuned setting beside "
        "it; nothing fitted", target="1.3x lower at the busiest expert 4x the mean"),
    Row("expert placement planned ahead of the gate (`planner.plan_ahead: path`)", "test_plan_ahead", fig_pytest,
        TEST, asserts="losses bitwise equal to static and Pro-Prophet placement, gradients equal up to Agg's "
        "summation order, and plan-ahead placed replicas of its own (forecast accuracy and step time: "
        "docs/expert-parallel.md)"),
    Row("block-sparse causal attention vs dense SDPA (2,048 tokens, density 0.5)", "sparse_attention",
        fig_sparse_attention,
        "measured; the cost model's two constants were fitted on this layer at 2,048 tokens before the kernel's "
        "last speed-up, so its 0.81x is in sample (1,024 tokens held out: 0.03-0.06 low)"),
)


def _flan_lengths(path: Path) -> list[str]:
    """FLAN-like sample lengths (log-normal, median 150, sigma 1.1, seed 0, up to 65,536 tokens, max 8,192:
    the micro-batching benchmark's stand-in for FLANv2) written to `path`; returns the `--lengths` argument."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(150), 1.1, 4000), 4, 8192).astype(int)
    lengths = lengths[np.cumsum(lengths) <= 65536]
    path.write_text(json.dumps([int(x) for x in lengths]), encoding="utf-8")
    return ["--lengths", str(path)]


# -------------------------------------------------------------------------------------------------- running

def command(run: Run, quick: bool) -> list[str]:
    """The run's words under --quick or --full, before its folder's arguments."""
    return list(run.quick if quick and run.quick is not None else run.argv)


def display(run: Run, quick: bool) -> str:
    """The command as a person would type it (with `--json FILE` for file-JSON runs)."""
    words = command(run, quick) + (["--json", "FILE"] if run.json == "file" else ["--json"] if run.json == "stdout"
                                   else [])
    return shlex.join(words)


def _argv(run: Run, quick: bool, folder: Path) -> tuple[list[str], Path | None]:
    """The subprocess argv (interpreter filled in) and where its JSON file goes (None: stdout or no JSON)."""
    words = command(run, quick)
    extra = run.prepare(folder) if run.prepare else []
    if "FILE" in words and extra:  # a placeholder the prepared file fills (`--lengths FILE`)
        i = words.index("FILE")
        words = words[:i - 1] + extra + words[i + 1:]
        extra = []
    out = folder / f"{run.name}.json" if run.json == "file" else None
    words = words + extra + (["--json", str(out)] if out else ["--json"] if run.json == "stdout" else [])
    if words[0] == "python":
        return [sys.executable, *words[1:]], out
    if words[0] == "moebal":
        return [sys.executable, "-c", "import sys; from moebal.cli import main; sys.exit(main())", *words[1:]], out
    return words, out


def _read_json(run: Run, out: Path | None, stdout: str) -> Any:
    """The run's own JSON: its --json file (with a `.summary.json` beside it merged in), or stdout's JSON."""
    if run.json == "file":
        if out is None or not out.exists():
            raise ValueError("the script wrote no JSON file")
        data = json.loads(out.read_text(encoding="utf-8"))
        side = out.with_suffix(".summary.json")
        if side.exists():
            data = {"records": data, **json.loads(side.read_text(encoding="utf-8"))}
        return data
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON on stdout")
    return json.loads(stdout[start:])


def _pytest_summary(stdout: str) -> str | None:
    lines = [ln.strip("= ").strip() for ln in stdout.splitlines() if (" passed" in ln or " failed" in ln
                                                                       or " error" in ln) and " in " in ln]
    return lines[-1] if lines else None


def execute(run: Run, quick: bool, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one command in its subprocess; a failure or timeout is recorded, never raised."""
    rec: dict[str, Any] = {"name": run.name, "command": display(run, quick)}
    try:
        argv, out = _argv(run, quick, folder)
    except Exception as e:  # noqa: BLE001 - a bad input file fails this run only
        return {**rec, "status": "failed", "message": f"preparing the inputs: {type(e).__name__}: {e}"}
    rec.update(argv=argv, commit=_commit(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_start=_load())
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=run.timeout_s)
    except subprocess.TimeoutExpired as e:
        return {**rec, "status": "failed", "exit_status": None, "wall_s": round(time.perf_counter() - t0, 1),
                "load_end": _load(), "message": f"timed out after {run.timeout_s:.0f} s",
                "stderr_tail": _tail(_text(e.stderr))}
    rec.update(exit_status=p.returncode, wall_s=round(time.perf_counter() - t0, 1), load_end=_load(),
               stdout_tail=_tail(p.stdout), stderr_tail=_tail(p.stderr))
    if run.json == "none":
        rec["result"] = {"pytest_summary": _pytest_summary(p.stdout)}
    else:
        try:
            rec["result"] = _read_json(run, out, p.stdout)
        except (ValueError, OSError) as e:
            rec["json_error"] = str(e)
    if p.returncode != 0:
        last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or [""]
        return {**rec, "status": "failed", "message": f"exit status {p.returncode}: {last[0][:500]}"}
    return {**rec, "status": "ok"}


def _commit() -> str | None:
    """The repository's HEAD commit (with "+dirty" when tracked files differ from it), None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _load() -> float | None:
    """The host's 1-minute load average now (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def figure(row: Row, rec: dict[str, Any] | None) -> str:
    """The row's figure from its run's record, or "n/a (reason)"."""
    if rec is None:
        return "n/a (not run: excluded by --only)"
    if rec["status"] == "skipped":
        return f"skipped ({rec['message']})"
    if "result" not in rec:
        return f"n/a ({rec.get('message') or rec.get('json_error', 'no JSON')})"
    try:
        text = row.figure(rec["result"])
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, ZeroDivisionError) as e:
        what = f"the JSON lacks {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        return f"n/a ({what})"
    if row.asserts:
        text = f"{row.asserts}: {text}"
    if row.target:
        text = f"{text} (target {row.target})"
    return text if rec["status"] == "ok" else f"{text} [run failed: {rec['message']}]"


def machine() -> dict[str, str]:
    """platform, CPU model, vector extensions, torch version and CUDA device of this machine, found now."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        fields = dict(ln.split(":", 1) for ln in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in ln)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu, flags = fields.get("model name", cpu), fields.get("flags", "").split()
    except OSError:
        pass
    # the vector extensions that decide CPU kernel speed (bf16 units, AVX-512, AVX2)
    isa = " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags)
    info = {"platform": platform.platform(), "cpu": cpu, "cpus": str(os.cpu_count()), "torch": "not installed",
            "cuda_device": "", "isa": isa}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def machine_label(mach: dict[str, str]) -> str:
    """The README's short name of a report's machine: the GPU's name, else CPU-AMX (AMX bf16 tiles), CPU-bf16
    (AVX-512 bf16 units), CPU-Xeon (an Intel Xeon without them), CPU-AVX2 (other x86 CPUs) or CPU (no
    /proc/cpuinfo flags recorded)."""
    if mach.get("cuda_device"):
        return str(mach["cuda_device"]).replace("NVIDIA ", "")
    isa = mach.get("isa", "")
    if "amx_bf16" in isa:
        return "CPU-AMX"
    if "bf16" in isa:
        return "CPU-bf16"
    if "Xeon" in mach.get("cpu", ""):
        return "CPU-Xeon"
    return "CPU-AVX2" if "avx2" in isa else "CPU"


def render(reports: Sequence[Path], rows: Sequence[Row], readme: Path | None) -> tuple[str, int]:
    """The table of the rows whose run succeeded in one of `reports` (a later report wins), machines by their
    short names; with `readme`, those rows' figure and machine cells written into its Results table (the other
    rows keep theirs). Returns the table and the number of rows filled."""
    picked: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
    for path in reports:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            runs, mach = data["runs"], data["machine"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"bench_all: --render {path}: not a bench_all JSON ({type(e).__name__}: {e})") from e
        picked.update({name: (rec, mach) for name, rec in runs.items() if rec.get("status") == "ok"})
    lines = ["| claim | figure | fitted / predicted | machine | command |", "|---|---|---|---|---|"]
    cells: dict[int, tuple[str, str]] = {}
    for i, row in enumerate(rows):
        if row.run not in picked:
            continue
        rec, mach = picked[row.run]
        result = rec.get("result")
        where = "test" if isinstance(result, dict) and "pytest_summary" in result else machine_label(mach)
        fig = _cell(figure(row, rec))
        if row.readme:
            cells[i] = (fig, where)
        lines.append("| " + " | ".join([_cell(row.claim), fig, _cell(row.basis), where,
                                         f"`{rec['command']}`"]) + " |")
    if readme is not None:
        write_text_whole(readme, _splice(readme.read_text(encoding="utf-8"), cells, len(rows)))
    return "\n".join(lines) + "\n", len(cells)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _splice(text: str, cells: dict[int, tuple[str, str]], n_rows: int) -> str:
    """README text with the figure and machine cells of its Results table's row i (in `ROWS` order) replaced."""
    head, sep, rest = text.partition("## Results")
    if not sep:
        raise SystemExit("bench_all: --readme: the README has no '## Results' section")
    section, nxt, tail = rest.partition("\n## ")
    lines = section.split("\n")
    at = [k for k, ln in enumerate(lines) if ln.startswith("| ") and not ln.startswith("| claim")]
    if len(at) != n_rows:
        raise SystemExit(f"bench_all: --readme: its Results table has {len(at)} rows, the registry {n_rows}; "
                         "add or remove README rows to match ROWS first")
    for i, (fig, where) in cells.items():
        parts = lines[at[i]].strip().strip("|").split(" | ")
        if len(parts) != 5:
            raise SystemExit(f"bench_all: --readme: Results row {i + 1} has {len(parts)} cells, not 5")
        parts[1], parts[3] = fig, where
        lines[at[i]] = "| " + " | ".join(p.strip() for p in parts) + " |"
    return head + sep + "\n".join(lines) + nxt + tail


def table(rows: Sequence[Row], recs: dict[str, dict[str, Any]], mach: dict[str, str]) -> str:
    """The markdown table: claim, figure, what was fitted and predicted, machine, command."""
    where = f"{mach['platform']} / {mach['cpu']} ({mach['cpus']} CPUs) / torch {mach['torch']}"
    lines = ["| claim | figure | fitted / predicted | machine | command |", "|---|---|---|---|---|"]
    for row in rows:
        rec = recs.get(row.run)
        gpu = f" / {mach['cuda_device']}" if mach["cuda_device"] else ""
        cmd = rec["command"] if rec else row.run
        cells = [row.claim, figure(row, rec), row.basis, where + gpu, f"`{cmd}`"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None, runs: Sequence[Run]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="each script's own quick form where it has one")
    mode.add_argument("--full", action="store_true", help="each command as the README names it (hours)")
    ap.add_argument("--json", type=Path, help="write the runs, their JSON and every row's figure here")
    ap.add_argument("--table", type=Path, help="write the markdown table here")
    ap.add_argument("--only", help="comma list of run names (see --dry-run)")
    ap.add_argument("--resume", type=Path, metavar="FILE",
                    help="a JSON an earlier run of the same mode wrote: keep its successful runs, run the rest")
    ap.add_argument("--dry-run", action="store_true", help="print one command per README row and stop")
    mode.add_argument("--render", type=Path, nargs="+", metavar="REPORT",
                      help="run nothing: the table of the rows that succeeded in these reports (a later one wins)")
    ap.add_argument("--readme", action="store_true",
                    help="with --render: write those rows' figure and machine cells into README.md")
    args = ap.parse_args(argv)
    if args.readme and not args.render:
        ap.error("--readme goes with --render REPORT ...")
    names = [r.name for r in runs]
    args.only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    bad = [n for n in args.only or [] if n not in names]
    if bad:
        ap.error(f"--only: unknown run(s) {', '.join(bad)}; choose from {', '.join(names)}")
    return args


def _resumed(path: Path, mode: str, mach: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The successful runs of an earlier report of this mode on this machine (a clear error otherwise)."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"bench_all: --resume {path}: cannot read it as a bench_all JSON ({e})") from e
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        raise SystemExit(f"bench_all: --resume {path}: not a bench_all JSON (no 'runs'); pass the file --json wrote")
    if report.get("mode") != mode:
        raise SystemExit(f"bench_all: --resume {path}: it was a --{report.get('mode')} run; resume it with "
                         f"--{report.get('mode')}, or start afresh without --resume")
    theirs = report.get("machine", {})
    differ = [k for k in ("cpu", "cpus", "torch", "cuda_device") if theirs.get(k) != mach[k]]
    if differ:
        raise SystemExit(f"bench_all: --resume {path}: it ran on another machine ({', '.join(differ)} differ: "
                         f"{[theirs.get(k) for k in differ]} here {[mach[k] for k in differ]}); one report holds "
                         "one machine's figures, so start afresh without --resume")
    return {name: rec for name, rec in report["runs"].items() if rec.get("status") == "ok"}


def main(argv: Sequence[str] | None = None, runs: Sequence[Run] = RUNS, rows: Sequence[Row] = ROWS,
         cuda: bool | None = None, readme: Path = ROOT / "README.md") -> int:
    """Run the registry (`runs`, `rows`: the README's by default); 0 when every selected run succeeded.
    `readme`: the file `--render --readme` writes."""
    args = parse(argv, runs)
    by_name = {r.name: r for r in runs}
    missing = sorted({row.run for row in rows} - set(by_name))
    if missing:
        raise SystemExit(f"bench_all: rows name runs that the registry lacks: {', '.join(missing)}")
    if args.render:
        text, filled = render(args.render, rows, readme if args.readme else None)
        if args.table:
            write_text_whole(args.table, text)
        print(text)
        print(f"bench_all: {filled} of {len(rows)} rows from {len(args.render)} report(s)", file=sys.stderr)
        return 0
    chosen = [r for r in runs if args.only is None or r.name in args.only]
    if args.dry_run:
        for row in rows:
            if args.only is None or row.run in args.only:
                print(f"{row.run:<24} {display(by_name[row.run], args.quick)}    # {row.claim}")
        return 0
    mach = machine()
    has_cuda = bool(mach["cuda_device"]) if cuda is None else cuda
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    mode = "quick" if args.quick else "full"
    kept = _resumed(args.resume, mode, mach) if args.resume else {}
    recs: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()

    def report(complete: bool) -> str:
        shown = [row for row in rows if row.run in recs]
        text = table(shown, recs, mach)
        missing = [r.name for r in runs if r.name not in recs]  # not run by this report (--only, or stopped)
        data = {"mode": mode, "complete": complete and not missing, "missing": missing, "machine": mach,
                "wall_s": round(time.perf_counter() - t0, 1),
                "runs": recs, "rows": [{"claim": row.claim, "run": row.run, "figure": figure(row, recs.get(row.run)),
                                        "basis": row.basis} for row in shown]}
        if args.json:  # whole or not at all: a stopped run never leaves half a report
            write_text_whole(args.json, json.dumps(data, indent=1, default=str) + "\n")
        if args.table:
            write_text_whole(args.table, text)
        return text

    with tempfile.TemporaryDirectory(prefix="bench-all-") as tmp:
        # a resumed report keeps its successful runs, chosen by --only or not, in every report written from now on
        for run in runs:
            if run.name in kept:
                recs[run.name] = {**kept[run.name], "resumed_from": str(args.resume)}
                print(f"bench_all: {run.name}: kept from {args.resume}", file=sys.stderr, flush=True)
        for run in chosen:
            if run.name in kept:
                continue
            if run.gpu and not has_cuda:
                recs[run.name] = {"name": run.name, "command": display(run, args.quick), "status": "skipped",
                                  "message": "needs a CUDA device; torch sees none"}
            else:
                print(f"bench_all: {run.name}: {display(run, args.quick)}", file=sys.stderr, flush=True)
                recs[run.name] = execute(run, args.quick, Path(tmp), env)
            rec = recs[run.name]
            print(f"bench_all: {run.name}: {rec['status']} {rec.get('wall_s', '')} {rec.get('message', '')}",
                  file=sys.stderr, flush=True)
            report(complete=False)
    print(report(complete=True))
    return 0 if all(r["status"] != "failed" for r in recs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
