"""What splitting the backward costs: a pipeline stage's CPU time with deferred weight gradients (zero bubble's
B + W) against the plain backward (1F1B's B), and W's share of the backward.

One process, one thread. A stage of the pipeline benchmark's GPT (dim 128, 4 heads, 2 KV heads, ffn 384, dense
layers) runs M micro-batches: every forward, then each micro-batch's backward, and under the split its W right
after its B (the order does not change the work; the schedule decides only where W waits). The two variants
alternate repeat by repeat, so drifts of a shared machine hit both; the figure is the median over repeats of
the CPU time per iteration (thread time), after warm-up. Precision: bf16 autocast on a CPU that computes bf16
natively (as `train.precision: auto` chooses), fp32 otherwise; `--precision` forces one.

    python scripts/bench_wgrad_split.py [--quick] [--json FILE] [--tokens 64,256,512] [--layers 6] [--micro 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from moebal.commands.bench import add_device_argument, script_device
from moebal.config import from_dict
from moebal.kernels.bench import environment
from moebal.models import build_model
from moebal.pipeline.zero_bubble import WeightGradQueue
from moebal.train.precision import bf16_native

CPU_ONLY = "it measures the CPU thread time of the backward pass"
"""Why `--device` accepts cpu only here."""

def _stage(tokens: int, layers: int) -> tuple[torch.nn.Module, Any, Any]:
    cfg = from_dict({"model": {"dim": 128, "n_layers": layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384,
                               "max_seq_len": tokens},
                     "moe": {"num_experts": 0}, "data": {"seq_len": tokens}, "train": {"seed": 0}})
    model = build_model(cfg)
    cos, sin = model.model.rotary(tokens, torch.float32)
    return model, cos, sin


def _iteration(model: torch.nn.Module, cos: Any, sin: Any, tokens: int, micro: int, queue: WeightGradQueue | None,
               bf16: bool) -> tuple[float, float, float]:
    """(CPU seconds of the iteration, of its backwards, of its W ops)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, tokens, 128, generator=g, requires_grad=True) for _ in range(micro)]
    gys = [torch.randn(1, tokens, 128, generator=g) for _ in range(micro)]
    t0 = time.thread_time()
    outs = []
    for j, x in enumerate(xs):
        with queue.capture(j) if queue else nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = x
            for layer in model.model.layers:
                h = layer(h, cos, sin)
        outs.append(h)
    back = w = 0.0
    for j, (h, gy) in enumerate(zip(outs, gys)):
        b0 = time.thread_time()
        h.backward(gy)
        b1 = time.thread_time()
        if queue is not None:
            for _, fn in queue.pop(j):
                fn()
        back += b1 - b0
        w += time.thread_time() - b1
    return time.thread_time() - t0, back + w, w


def measure(tokens: int, layers: int, micro: int, repeats: int, bf16: bool) -> dict[str, Any]:
    model, cos, sin = _stage(tokens, layers)
    queue = WeightGradQueue()
    runs: dict[str, list[tuple[float, float, float]]] = {"plain": [], "split": []}
    warm = max(2, repeats // 5)
    for rep in range(repeats + warm):
        for name in ("plain", "split") if rep % 2 == 0 else ("split", "plain"):
            if name == "split":
                with queue.installed(model):
                    r = _iteration(model, cos, sin, tokens, micro, queue, bf16)
            else:
                r = _iteration(model, cos, sin, tokens, micro, None, bf16)
            if rep >= warm:
                runs[name].append(r)
        model.zero_grad(set_to_none=True)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
    ratios = [s[0] / p[0] for p, s in zip(runs["plain"], runs["split"])]
    return {"tokens": tokens, "layers": layers, "micro_batches": micro, "repeats": repeats,
            "plain_iteration_cpu_s": med["plain"][0], "split_iteration_cpu_s": med["split"][0],
            "split_over_plain": statistics.median(ratios),
            "plain_backward_cpu_s": med["plain"][1], "split_backward_cpu_s": med["split"][1],
            "w_cpu_s": med["split"][2], "w_share_of_backward": med["split"][2] / med["split"][1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, one row length")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tokens", default="64,256,512", help="row lengths (tokens per micro-batch), comma-separated")
    ap.add_argument("--layers", type=int, default=6, help="dense layers in the stage (default 6: 24 / 4 stages)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per iteration")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    try:
        lengths = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    if not lengths or min(lengths) < 1 or args.layers < 1 or args.micro < 1:
        ap.error("--tokens, --layers and --micro must be positive")
    torch.set_num_threads(1)
    bf16 = bf16_native(torch.device("cpu")) if args.precision == "auto" else args.precision == "bf16"
    repeats = 8 if args.quick else 30
    rows = []
    for t in lengths[:1] if args.quick else lengths:
        row = measure(t, args.layers, args.micro, repeats, bf16)
        rows.append(row)
        plain_ms, split_ms = row["plain_iteration_cpu_s"] * 1e3, row["split_iteration_cpu_s"] * 1e3
        print(f"{t:>5} tokens: split / plain CPU {row['split_over_plain']:.3f}x (plain {plain_ms:.1f} ms, "
              f"split {split_ms:.1f} ms), W {row['w_share_of_backward']:.2f} of the backward", file=sys.stderr)
    report = {"benchmark": "wgrad_split", "precision": "bf16" if bf16 else "fp32", "records": rows,
              "env": environment()}
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
