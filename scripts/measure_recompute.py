"""Activation memory and step time of `train.recompute` modes: each mode's training step in a fresh process.

Each measurement is its own subprocess (ru_maxrss is a process-lifetime peak): build the model, run one tiny
step so gradients exist (zero_grad keeps them), note the resident set, then run `--steps` full steps; the
activation peak is ru_maxrss minus that resident set, the step time the median of the steps. Modes are rotated
per round (round r starts at mode r), every round is reported, and per mode the median over rounds.

    python scripts/measure_recompute.py --json recompute.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from typing import Any

from moebal.commands.bench import at_least

MODES = ("none", "moe", "attention", "full")


def _config(args: argparse.Namespace, mode: str) -> Any:
    from moebal.config import from_dict

    return from_dict({
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 8,
                  "ffn_dim": 4 * args.dim, "max_seq_len": args.seq},
        "moe": {"num_experts": args.experts, "top_k": 2, "expert_ffn_dim": 2 * args.dim, "kernel": "loop"},
        "data": {"seq_len": args.seq}, "train": {"recompute": mode}})


def child(args: argparse.Namespace) -> None:
    """One mode in this process: prints one JSON line."""
    import resource
    import time

    import torch

    from moebal.models import build_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(_config(args, args.child))
    model.train()

    def step(B: int, T: int) -> None:
        ids = torch.randint(0, 256, (B, T))
        out = model(ids, ids)
        (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=False)

    step(1, 8)  # gradients allocated, kept
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * resource.getpagesize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(args.batch, args.seq)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    print(json.dumps({"mode": args.child, "base_mb": base / 2**20, "act_peak_mb": (peak - base) / 2**20,
                      "step_s": statistics.median(times), "steps_s": times}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=at_least(1), default=512)
    p.add_argument("--layers", type=at_least(1), default=8)
    p.add_argument("--seq", type=at_least(1), default=512)
    p.add_argument("--batch", type=at_least(1), default=8)
    p.add_argument("--experts", type=at_least(1), default=8)
    p.add_argument("--steps", type=at_least(1), default=2)
    p.add_argument("--rounds", type=at_least(1), default=2)
    p.add_argument("--threads", type=at_least(1), default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rounds: list[list[dict[str, Any]]] = []
    passthrough = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("child", "json", "rounds")]
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        rows = []
        for mode in order:
            out = subprocess.run([sys.executable, __file__, *passthrough, "--child", mode], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} {rows[-1]}", flush=True)
        rounds.append(rows)
    summary = {}
    for mode in MODES:
        act = statistics.median(row["act_peak_mb"] for rs in rounds for row in rs if row["mode"] == mode)
        t = statistics.median(row["step_s"] for rs in rounds for row in rs if row["mode"] == mode)
        summary[mode] = {"act_peak_mb": act, "step_s": t}
    for mode in MODES:
        summary[mode]["act_ratio"] = summary[mode]["act_peak_mb"] / summary["none"]["act_peak_mb"]
        summary[mode]["time_ratio"] = summary[mode]["step_s"] / summary["none"]["step_s"]
    import torch

    result = {"machine": platform.machine(), "torch": torch.__version__, "python": platform.python_version(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
              "summary": summary, "rounds": rounds}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
