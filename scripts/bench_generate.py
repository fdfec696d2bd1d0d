"""Text generation's decode throughput: the KV cache against the whole-prefix forward, and a batch of prompts
against the same prompts one at a time (moebal/models/generate.py, docs/generate.md).

The model is the default run's (`moebal train` with no config: 4 layers, d 256, 8 experts top-2), initialised
from seed 0 (decode speed does not depend on the weights; `--run DIR` serves a run's checkpoint instead), fp32 on
the CPU. Four modes, each round running every one once in a rotated order, all in this process:

  cache         one prompt, the KV-cached decoder
  no_cache      the same prompt, the model's forward over the whole prefix per new token
  batch         `--prompts` prompts of different lengths decoded as one batch
  one_by_one    the same prompts, each alone with the cache

A mode's figure is its new tokens after the first over its decoding time (the first token's forward, the
prompt's, is reported apart), summed over its prompts; medians over the rounds, every round in the JSON. The
ratios (cache / no_cache, batch / one_by_one) are of the medians. Greedy decoding, so each pair must give the
same tokens (`equal`); the run fails when they do not.

    python scripts/bench_generate.py [--prompt-len 64] [--new 128] [--prompts 8] [--rounds 3] [--quick]
                                     [--run DIR] [--json FILE]
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

import torch

from moebal.kernels.bench import environment
from moebal.models.generate import Generation, generate_many

MODES = ("cache", "no_cache", "batch", "one_by_one")

TEXT = (b"def main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
        b"    parser.add_argument('--out', default=None)\n    args = parser.parse_args(argv)\n"
        b"    return run(args)\n\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n") * 4


def prompts(length: int, count: int) -> tuple[list[int], list[list[int]]]:
    """(the single prompt of `length` tokens, `count` prompts from length / 2 up to length, each from its own
    offset of the same text)."""
    single = list(TEXT[:length])
    many = [list(TEXT[7 * i:7 * i + max(1, length // 2 + (length // 2) * i // max(count - 1, 1))])
            for i in range(count)]
    return single, many


def load_model(run: str | None) -> Any:
    if run is None:
        from moebal.config import Config
        from moebal.models import build_model

        torch.manual_seed(0)
        return build_model(Config()).eval()
    from moebal.commands.generate import load_source

    return load_source(Path(run)).model


def measure(model: Any, mode: str, single: list[int], many: list[list[int]], new: int) -> list[Generation]:
    if mode == "cache":
        return generate_many(model, [single], new)
    if mode == "no_cache":
        return generate_many(model, [single], new, cache=False)
    if mode == "batch":
        return generate_many(model, many, new)
    return [g for p in many for g in generate_many(model, [p], new)]


def rate(gens: list[Generation], mode: str) -> tuple[float, float]:
    """(new tokens after the first per second of decoding, the first token's seconds), summed over the prompts
    (a batch's rows share one decoding time)."""
    tokens = sum(len(g.tokens) - 1 for g in gens)
    shared = mode == "batch"
    decode = gens[0].decode_s if shared else sum(g.decode_s for g in gens)
    first = gens[0].prefill_s if shared else sum(g.prefill_s for g in gens)
    return tokens / decode, first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=64, help="the single prompt's tokens (default 64)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the batch modes (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, modes rotated in each (default 3)")
    ap.add_argument("--run", default=None, help="serve this run directory's checkpoint instead of the default model")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 24 new tokens (a smoke run)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.new = 2, 24
    if min(args.prompt_len, args.new, args.prompts, args.rounds) < 1:
        ap.error("--prompt-len, --new, --prompts and --rounds must be >= 1")
    model = load_model(args.run)
    single, many = prompts(args.prompt_len, args.prompts)
    measure(model, "cache", single[:8], many[:2], 4)  # warm-up: first calls allocate and pick kernels
    rounds: list[dict[str, Any]] = []
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        row: dict[str, Any] = {"order": list(order)}
        for mode in order:
            t0 = time.perf_counter()
            gens = measure(model, mode, single, many, args.new)
            tps, first = rate(gens, mode)
            row[mode] = {"tokens_per_s": round(tps, 2), "first_token_s": round(first, 5),
                         "wall_s": round(time.perf_counter() - t0, 3)}
            tokens[mode] = [g.tokens for g in gens]
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{m} {row[m]['tokens_per_s']:.1f}" for m in MODES) + " tokens/s",
              file=sys.stderr)
    med = {m: statistics.median(r[m]["tokens_per_s"] for r in rounds) for m in MODES}
    report = {
        "settings": {"prompt_len": args.prompt_len, "new": args.new, "prompts": [len(p) for p in many],
                     "rounds": args.rounds, "run": args.run, "model_parameters": model.num_parameters(),
                     "dtype": "fp32", "quick": args.quick},
        "environment": environment(), "load_avg": list(os.getloadavg()), "rounds": rounds,
        "median_tokens_per_s": med,
        "cache_over_no_cache": round(med["cache"] / med["no_cache"], 3),
        "batch_over_one_by_one": round(med["batch"] / med["one_by_one"], 3),
        "equal": {"cache_no_cache": tokens["cache"] == tokens["no_cache"],
                  "batch_one_by_one": tokens["batch"] == tokens["one_by_one"]},
    }
    print(json.dumps({k: report[k] for k in ("median_tokens_per_s", "cache_over_no_cache", "batch_over_one_by_one",
                                             "equal")}), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0 if all(report["equal"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
