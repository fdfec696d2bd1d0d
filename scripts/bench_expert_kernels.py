"""The two expert back ends (`loop`, `grouped_mm`) side by side over row counts: is a per-size choice worth it?

    python scripts/bench_expert_kernels.py [--dim 256] [--ffn 512] [--experts 4] [--rows 512,1024,...]
                                           [--dtypes fp32,bf16] [--repeats 7] [--threads N] [--json FILE]
                                           [--device cuda|cpu]

Forward + backward of `swiglu_experts` on balanced routing (each row's expert drawn uniformly), both kernels
interleaved in one process (`time_interleaved`: warm-up, repeats, median/min/max, process CPU time), for every
row count and dtype. The defaults are the default run's expert layer on one of its two expert-parallel ranks
(dim 256, experts 512 wide, 4 local experts; about 2,048 rows per rank and layer, fewer per token chunk).
The JSON records the environment, the load average before and after each case, and every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from moebal.commands.bench import add_device_argument, at_least, script_device
from moebal.kernels import environment, make_plan, swiglu_experts, time_interleaved
from moebal.kernels.expert_ffn import KERNELS, grouped_mm_supports

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def case(rows: int, dim: int, ffn: int, experts: int, dtype: torch.dtype, repeats: int,
         device: torch.device | None = None) -> dict:
    device = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU, then moved: the same data on every device
    plan = make_plan(torch.randint(0, experts, (rows, 1), generator=gen).to(device), None, experts)
    x = torch.randn(rows, dim, generator=gen).to(device, dtype).requires_grad_()
    ws = [(torch.randn(experts, a, b, generator=gen) * 0.02).to(device, dtype).requires_grad_()
          for a, b in ((ffn, dim), (ffn, dim), (dim, ffn))]

    def step(kernel: str):
        def run() -> None:
            swiglu_experts(x, *ws, plan, kernel).sum().backward()  # type: ignore[arg-type]
        return run

    kernels = [k for k in KERNELS if k == "loop" or grouped_mm_supports(dim, ffn, dtype)]
    load0 = os.getloadavg()[0]
    t = time_interleaved({k: step(k) for k in kernels}, warmup=1, repeats=repeats, device=device)
    out = {"rows": rows, "dtype": str(dtype).removeprefix("torch."), "load_before": load0,
           "load_after": os.getloadavg()[0], "timings": {k: v.to_dict() for k, v in t.items()}}
    if "grouped_mm" in t:
        out["grouped_mm_over_loop"] = t["grouped_mm"].median / t["loop"].median
        out["grouped_mm_over_loop_cpu"] = t["grouped_mm"].cpu_median / t["loop"].cpu_median
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=at_least(1), default=256)
    p.add_argument("--ffn", type=at_least(1), default=512)
    p.add_argument("--experts", type=at_least(1), default=4)
    p.add_argument("--rows", default="256,512,1024,2048,4096,8192")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=at_least(1), default=7)
    p.add_argument("--threads", type=at_least(1), default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="FILE")
    add_device_argument(p)
    a = p.parse_args(argv)
    device = script_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    records = []
    for name in a.dtypes.split(","):
        for rows in (int(r) for r in a.rows.split(",")):
            r = case(rows, a.dim, a.ffn, a.experts, DTYPES[name], a.repeats, device)
            records.append(r)
            ratio = r.get("grouped_mm_over_loop")
            print(f"{name} rows {rows:6d}  loop {1e3 * r['timings']['loop']['median']:8.2f} ms  "
                  + (f"grouped_mm/loop {ratio:5.2f}x (cpu time {r['grouped_mm_over_loop_cpu']:5.2f}x)"
                     if ratio else "grouped_mm unsupported") + f"  load {r['load_before']:.1f}", flush=True)
    if a.json:
        shape = {"dim": a.dim, "ffn": a.ffn, "experts": a.experts, "threads": torch.get_num_threads(),
                 "device": str(device)}
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"environment": environment(), "shape": shape, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
