"""Block-sparse causal attention: time (forward + backward) against density, beside the dense SDPA path.

The dense figure is what `Attention` runs today (`scaled_dot_product_attention(is_causal=True, enable_gqa)`);
the sparse one is the `sparse_attention` scheme's whole attention core: block selection (pooled scores, top-k)
plus `block_sparse_attention` on its default path for the shape (`default_path`), with the other path beside
it. Shapes are the pipeline benchmark's heads (4 query heads, 2 key/value heads, head dim 32) on one
2,048-token row, 1 thread. Methods are timed interleaved (`time_interleaved`, every round calls each once in a
rotated order; medians of repeats, every round's samples in the JSON); the ratio is of CPU-time medians (the
machine is shared; wall time beside it, and the load average before and after). Target: at most 0.6x the dense
time at density 0.5.

`--layer`: the same for a whole decoder layer of the pipeline benchmark's model (dim 128, 4 heads, 2 key/value
heads, FFN 384) run through the scheme (`DynamicSparseAttention.layer_forward`), each density's measured time
over the dense layer's beside the scheme's prediction (`cost_factors`): the cost model against measured times.
Beside them the scheme's two constants (`attn_weight`, `overhead`) fitted to these rows by least squares
(`moebal.planner.sparse_blocks.fit_cost_constants`) and the factors they give: in sample, the values to set for a
run on this machine and shape (`dynamism.sparse_attention.attn_weight=W dynamism.sparse_attention.overhead=O`).
And held out: the constants a run fits at start-up (`costs: measure`, the default: the attention module alone,
timed by `measure_attention_factors` at the layer's shape, one row, its own timing after the layer's) and the
factors they give for the whole layer (`startup`), scored against the layer's measured rows.

    python scripts/bench_sparse_attention.py [--seq 2048] [--block 128] [--repeats 7] [--layer] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moebal.commands.bench import at_least
from moebal.kernels.bench import environment, sample_interleaved, summarise, time_interleaved
from moebal.kernels.sparse_attention import (
    PATHS,
    block_sparse_attention,
    default_path,
    kept_fraction,
    select_blocks,
    trainable_paths,
)

DENSITIES = (1.0, 0.75, 0.5, 0.25, 0.1)


def measure(seq: int, block: int, repeats: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 32
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows per density (each path's median CPU time over the dense one's) and every round's samples."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, head_dim, generator=g).requires_grad_(True)
    k = torch.randn(1, kv_heads, seq, head_dim, generator=g).requires_grad_(True)
    v = torch.randn(1, kv_heads, seq, head_dim, generator=g).requires_grad_(True)
    default = default_path(q.device, block, heads // kv_heads)

    def dense() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def sparse(d: float, path: str) -> Any:
        def run() -> None:
            block_sparse_attention(q, k, v, select_blocks(q, k, block, d), path=path).sum().backward()
        return run

    paths = [default] + [p for p in trainable_paths(q.device) if p != default]
    fns = {"dense": dense, **{f"{p}@{d}": sparse(d, p) for d in DENSITIES for p in paths}}
    wall, cpu = sample_interleaved(fns, warmup=2, repeats=repeats)
    t = {name: summarise(wall[name], cpu[name]) for name in fns}
    rows = []
    for d in DENSITIES:
        row: dict[str, Any] = {"density": d, "kept_fraction": round(kept_fraction(seq, block, d), 4), "block": block,
                               "seq_len": seq, "path": default, "dense_cpu_s": t["dense"].cpu_median}
        for p in paths:
            s = t[f"{p}@{d}"]
            key = "" if p == default else f"_{p}"
            row.update({f"sparse{key}_cpu_s": s.cpu_median,
                        f"ratio_cpu{key}": round(s.cpu_median / t["dense"].cpu_median, 3),
                        f"ratio_wall{key}": round(s.median / t["dense"].median, 3)})
        rows.append(row)
    return rows, {"wall_s": wall, "cpu_s": cpu}


def measure_layer(seq: int, block: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Measured fwd+bwd CPU time of one decoder layer at each density over the dense layer's, the scheme's
    predicted factor, and (`fitted`) the factor with its two constants fitted to these rows
    (`fit_cost_constants`); the fitted constants and the fit's largest error beside."""
    from moebal.config import from_dict
    from moebal.dynamism.scheme import build_dynamism, layer_token_flops
    from moebal.dynamism.sparse_attention import fit_attention_factors, measure_attention_factors
    from moebal.models import build_model
    from moebal.planner.sparse_blocks import fit_cost_constants

    cfg = from_dict({"model": {"dim": 128, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384,
                               "max_seq_len": seq},
                     "moe": {"num_experts": 0}, "data": {"seq_len": seq, "batch_size": 1}})
    torch.manual_seed(0)
    model = build_model(cfg)
    layer = model.model.layers[0]
    cos, sin = model.model.rotary(seq, torch.float32)
    h = torch.randn(1, seq, 128, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    scheme = build_dynamism("sparse_attention", {"budget": "random_walk", "block": block, "costs": "given"}, cfg=cfg)
    scheme.begin_step(scheme.start + 1)  # active (before its start the scheme runs the plain layer)

    def at(d: float) -> Any:
        def run() -> None:
            scheme.density = [d]
            layer.zero_grad(set_to_none=True)
            scheme.layer_forward(0, layer, h, cos, sin, {}).sum().backward()
        return run

    t = time_interleaved({d: at(d) for d in DENSITIES}, warmup=2, repeats=repeats)
    measured = {d: t[d].cpu_median / t[1.0].cpu_median for d in DENSITIES}
    rows = []
    for d in DENSITIES:
        scheme.density = [d]
        rows.append({"density": d, "measured": round(measured[d], 3),
                     "predicted": round(scheme.cost_factors(1)[0], 3), "layer_cpu_s": t[d].cpu_median})
    def scored(w: float, o: float, key: str) -> dict[str, Any]:
        """Each row's factor under constants (w, o) as `key`; the constants and the largest error."""
        scheme.attn_weight, scheme.overhead = w, o
        for r in rows:
            scheme.density = [r["density"]]
            r[key] = round(scheme.cost_factors(1)[0], 3)
        return {"attn_weight": round(w, 3), "overhead": round(o, 3), "max_abs_error": _worst(rows, key, measured)}

    f = layer_token_flops(cfg, 0, seq)
    fit: dict[str, Any] = scored(*fit_cost_constants(
        [(kept_fraction(seq, block, d), measured[d]) for d in DENSITIES if d < 1.0],
        f["q_o"] + f["kv"] + f["ffn"], f["attn"]), "fitted")
    # the start-up fit of `costs: measure` (held out: another measurement, of the attention module alone)
    factors = measure_attention_factors(cfg, block, seq, torch.device("cpu"), repeats=repeats)
    try:
        startup = scored(*fit_attention_factors(cfg, block, factors), "startup")
    except ValueError as e:
        fit["startup"] = {"factors": [round(m, 3) for m in factors], "error": str(e)}
        return rows, fit
    fit["startup"] = {**startup, "factors": [round(m, 3) for m in factors],
                      "given_max_abs_error": _worst(rows, "predicted", measured)}
    return rows, fit


def _worst(rows: list[dict[str, Any]], key: str, measured: dict[float, float]) -> float:
    """The largest |rows' `key` - the measured factor at its density|."""
    return round(max(abs(r[key] - measured[r["density"]]) for r in rows), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=at_least(1), default=2048)
    ap.add_argument("--block", type=at_least(1), default=128)
    ap.add_argument("--repeats", type=at_least(1), default=7)
    ap.add_argument("--layer", action="store_true", help="also time a whole layer against the cost model")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.block < 1 or args.seq % args.block or args.seq // args.block < 2:
        ap.error(f"--block ({args.block}) must divide --seq ({args.seq}) into at least 2 blocks")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows, samples = measure(args.seq, args.block, args.repeats)
    at_half = next(r for r in rows if r["density"] == 0.5)["ratio_cpu"]
    for r in rows:
        other = "".join(f" ({p} path {r[f'ratio_cpu_{p}']:.3f})" for p in PATHS if f"ratio_cpu_{p}" in r)
        print(f"density {r['density']:<5} kept {r['kept_fraction']:<6} sparse/dense cpu {r['ratio_cpu']:.3f} "
              f"wall {r['ratio_wall']:.3f} [{r['path']}]{other}", file=sys.stderr)
    layer, fit = measure_layer(args.seq, args.block, args.repeats) if args.layer else ([], {})
    for r in layer:
        startup = f" start-up fit {r['startup']:.3f}" if "startup" in r else ""
        print(f"layer at density {r['density']:<5} measured {r['measured']:.3f} predicted {r['predicted']:.3f} "
              f"fitted {r['fitted']:.3f}{startup}", file=sys.stderr)
    if fit:
        print(f"constants fitted to these rows (in sample; largest error {fit['max_abs_error']:.3f}): "
              f"dynamism.sparse_attention.attn_weight={fit['attn_weight']} "
              f"dynamism.sparse_attention.overhead={fit['overhead']}", file=sys.stderr)
        up = fit["startup"]
        print("start-up fit (costs: measure; held out): " + (
            f"attn_weight {up['attn_weight']} overhead {up['overhead']}, largest error {up['max_abs_error']:.3f} "
            f"(given constants: {up['given_max_abs_error']:.3f})" if "error" not in up else f"not fitted: "
            f"{up['error']}"), file=sys.stderr)
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"load average (1, 5, 15 min) before {load['before']} after {load['after']}", file=sys.stderr)
    report = {"benchmark": "sparse_attention", "rows": rows, "layer": layer, "layer_fit": fit, "samples": samples,
              "load": load,
              "target": {"sparse/dense at density 0.5 <= 0.6": {"measured": at_half, "met": at_half <= 0.6}},
              "config": {"seq": args.seq, "block": args.block, "repeats": args.repeats, "heads": 4, "kv_heads": 2,
                         "head_dim": 32, "threads": 1},
              "env": environment()}
    print(json.dumps(report["target"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
