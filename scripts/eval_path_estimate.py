"""How well Lina's sample-path estimate forecasts a batch's expert loads, against Pro-Prophet's previous-batch one.

A training run records its routing (train.record_routing_every=N); the profile is built on the first part of
the samples (`--share`, step order) and both forecasts are scored on the later samples, per MoE layer j:
  path:      the sum over the batch's tokens of their paths' distributions of layer j (moebal/planner/paths.py),
             whole distributions, and Lina's top-k truncation ("path-topk"); layer 0 has no path before it, so
             there every token gets the layer's profiled marginal (the same for every path length);
  previous:  the previous batch's counts of layer j (the previous recorded sample, N steps earlier; within a
             sample cut into smaller batches, the previous cut), scaled to the batch's token count.
Scores (moebal.planner.paths.estimate_accuracy): overlap of the top-2k experts (share), how often the top-2k sets
are equal (Lina's "accurate"), mean absolute error of the counts (and as a share of the mean count). "all" is the
mean over layers 1 .. L-1 (the layers with a path before them); every layer, layer 0 included, is under "layers".

Usage: python scripts/eval_path_estimate.py RUN_DIR [--json OUT] [--share 0.6] [--skip 0.3] [--batch 512 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moebal.commands.bench import at_least
from moebal.planner.paths import PathProfile, build_profile, estimate_accuracy, previous_estimate
from moebal.train.routing_log import load_routing

METRICS = ("overlap", "equal", "mae", "rel_mae")


def _batches(samples: list[np.ndarray], size: int) -> list[np.ndarray]:
    """Each sample [L, T, K] cut into batches of `size` tokens, in order (a sample's remainder dropped)."""
    out = []
    for s in samples:
        T = s.shape[1]
        out += [s[:, i:i + size] for i in range(0, T - size + 1, size)]
    return out


Scores = dict[str, dict[int, list[dict[str, float]]]]  # forecast -> layer -> one score per batch


def _score(prof: dict[int, PathProfile], batches: list[np.ndarray], E: int) -> Scores:
    K = batches[0].shape[2]
    scores: Scores = {}
    for b in range(1, len(batches)):
        ids, prev = batches[b], batches[b - 1]
        L, T, _ = ids.shape
        top1_TL = ids[:, :, 0].T
        for j in range(L):
            actual = np.bincount(ids[j].reshape(-1), minlength=E)
            fc: dict[str, np.ndarray] = {
                "previous": previous_estimate(np.bincount(prev[j].reshape(-1), minlength=E), prev.shape[1], T)}
            for l_, p in prof.items():
                fc[f"path-l{l_}"] = p.estimate(top1_TL, j)
            fc[f"path-l{max(prof)}-topk"] = prof[max(prof)].estimate(top1_TL, j, truncate=K)
            for name, pred in fc.items():
                scores.setdefault(name, {}).setdefault(j, []).append(estimate_accuracy(pred, actual, 2 * K))
    return scores


def _summary(scores: Scores) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, per_layer in scores.items():
        layers = {str(j): {m: float(np.mean([s[m] for s in v])) for m in METRICS} for j, v in per_layer.items()}
        every = [s for j, v in per_layer.items() if j >= 1 for s in v]
        out[name] = {"all": {m: float(np.mean([s[m] for s in every])) for m in METRICS}, "layers": layers,
                     "n": len(every)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--share", type=float, default=0.6, help="samples (step order) that build the profile")
    ap.add_argument("--skip", type=float, default=0.0, help="leave out this first share of the samples (Lina "
                    "profiles once the balancing loss is stable)")
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=[512, 64], help="tokens per scored batch")
    ap.add_argument("--path-len", type=at_least(1), nargs="+", default=[1, 2, 3], help="path lengths l to compare")
    ap.add_argument("--num-experts", type=at_least(1), default=None)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    samples = load_routing(args.run_dir)
    cut = int(round(len(samples) * args.share))
    if not 1 <= cut < len(samples) - 1:
        sys.exit(f"--share {args.share} leaves no samples to profile or to score ({len(samples)} samples)")
    E = args.num_experts or int(max(s.max() for s in samples)) + 1
    first = int(round(len(samples) * args.skip))
    if first >= cut:
        sys.exit(f"--skip {args.skip} leaves no samples to profile before --share {args.share}")
    tokens = samples[0].shape[1]
    if max(args.batch) > tokens:  # a batch is cut from one sample (the previous batch forecasts the next)
        sys.exit(f"--batch {max(args.batch)} is more than a routing sample's {tokens} tokens: give at most {tokens}")
    prof = {l_: build_profile(samples[first:cut], E, l_) for l_ in args.path_len}
    res: dict[str, Any] = {
        "run_dir": "RUN_DIR", "samples": len(samples), "profiled": [first, cut],
        "scored": len(samples) - cut,
        "shape_LTK": list(samples[0].shape), "num_experts": E, "top_n": 2 * samples[0].shape[2],
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "in_sample": _summary(_score(prof, _batches(samples[first:cut], samples[0].shape[1]), E)),
        "batches": {str(b): _summary(_score(prof, _batches(samples[cut:], b), E)) for b in args.batch},
    }
    text = json.dumps(res, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    for b, table in res["batches"].items():
        print(f"batch {b} tokens, held-out ({res['scored']} samples after {cut}):")
        for name, v in table.items():
            a = v["all"]
            z = v["layers"]["0"]
            print(f"  {name:16s} top-{res['top_n']} overlap {a['overlap']:.3f}  equal {a['equal']:.3f}  "
                  f"MAE {a['mae']:.2f} ({a['rel_mae']:.3f} of mean); layer 0: overlap {z['overlap']:.3f}  "
                  f"equal {z['equal']:.3f}  MAE {z['rel_mae']:.3f} of mean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
