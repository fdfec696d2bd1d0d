"""Text generation's decode throughput: the KV cache against the whole-prefix forward, and a batch of prompts
against the same prompts one at a time, and multi-head latent attention's latent cache against its per-head keys
and values (moebal/models/generate.py, docs/generate.md).

The model is the default run's (`moebal train` with no config: 4 layers, d 256, 8 experts top-2), initialised
from seed 0 (decode speed does not depend on the weights; `--run DIR` serves a run's checkpoint instead), fp32 on
the CPU. The two MLA modes serve the same model with multi-head latent attention in place of its grouped-query
attention (DeepSeek-V3's layout scaled down: 8 heads, latent C 64, rotary R 16, N and V 32: a per-head cache of
8 x (32 + 16 + 32) = 640 numbers per position and layer against C + R = 80 for the latent), seed 0. Six modes,
each round running every one once in a rotated order, all in this process:

  cache         one prompt, the KV-cached decoder
  no_cache      the same prompt, the model's forward over the whole prefix per new token
  batch         `--prompts` prompts of different lengths decoded as one batch
  one_by_one    the same prompts, each alone with the cache
  mla_latent    the single prompt on the MLA model, its latent cached (the default)
  mla_per_head  the same, its per-head keys and values cached (KVCache(latent=False))

A mode's figure is its new tokens after the first over its decoding time (the first token's forward, the
prompt's, is reported apart), summed over its prompts; medians over the rounds, every round in the JSON. The
ratios (cache / no_cache, batch / one_by_one, mla_latent / mla_per_head) are of the medians; the MLA pair's cache
bytes per position are reported beside them. Greedy decoding, so each pair must give the same tokens (`equal`);
the run fails when they do not.

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

MODES = ("cache", "no_cache", "batch", "one_by_one", "mla_latent", "mla_per_head")

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
    from moebal.errors import ConfigError

    try:
        return load_source(Path(run)).model
    except ConfigError as e:
        raise SystemExit(f"error: --run {e}") from None


def mla_model() -> Any:
    """The default model with multi-head latent attention (the module docstring's shape), seed 0."""
    from moebal.config import from_dict
    from moebal.models import build_model

    torch.manual_seed(0)
    mla = {"q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}
    return build_model(from_dict({"model": {"mla": mla, "n_kv_heads": 8}})).eval()


def measure(models: dict[str, Any], mode: str, single: list[int], many: list[list[int]],
            new: int) -> list[Generation]:
    model = models["mla" if mode.startswith("mla") else "main"]
    if mode.startswith("mla"):
        return generate_many(model, [single], new, latent=mode == "mla_latent")
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
    models = {"main": load_model(args.run), "mla": mla_model()}
    model = models["main"]
    single, many = prompts(args.prompt_len, args.prompts)
    for mode in MODES:  # warm-up, every mode: first calls allocate and pick kernels
        measure(models, mode, single[:8], many[:2], 4)
    cache_bytes: dict[str, int] = {}
    rounds: list[dict[str, Any]] = []
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        row: dict[str, Any] = {"order": list(order)}
        for mode in order:
            t0 = time.perf_counter()
            gens = measure(models, mode, single, many, args.new)
            tps, first = rate(gens, mode)
            row[mode] = {"tokens_per_s": round(tps, 2), "first_token_s": round(first, 5),
                         "wall_s": round(time.perf_counter() - t0, 3)}
            tokens[mode] = [g.tokens for g in gens]
            cache_bytes[mode] = gens[0].cache_bytes
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{m} {row[m]['tokens_per_s']:.1f}" for m in MODES) + " tokens/s",
              file=sys.stderr)
    med = {m: statistics.median(r[m]["tokens_per_s"] for r in rounds) for m in MODES}
    report = {
        "settings": {"prompt_len": args.prompt_len, "new": args.new, "prompts": [len(p) for p in many],
                     "rounds": args.rounds, "run": args.run, "model_parameters": model.num_parameters(),
                     "mla_model_parameters": models["mla"].num_parameters(),
                     "dtype": "fp32", "quick": args.quick},
        "environment": environment(), "load_avg": list(os.getloadavg()), "rounds": rounds,
        "median_tokens_per_s": med,
        "cache_over_no_cache": round(med["cache"] / med["no_cache"], 3),
        "batch_over_one_by_one": round(med["batch"] / med["one_by_one"], 3),
        "mla_latent_over_per_head": round(med["mla_latent"] / med["mla_per_head"], 3),
        "mla_cache_bytes_per_position": {m: cache_bytes[m] for m in ("mla_latent", "mla_per_head")},
        "equal": {"cache_no_cache": tokens["cache"] == tokens["no_cache"],
                  "batch_one_by_one": tokens["batch"] == tokens["one_by_one"],
                  "mla_latent_per_head": tokens["mla_latent"] == tokens["mla_per_head"]},
    }
    print(json.dumps({k: report[k] for k in ("median_tokens_per_s", "cache_over_no_cache", "batch_over_one_by_one",
                                             "mla_latent_over_per_head", "mla_cache_bytes_per_position", "equal")}),
          file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0 if all(report["equal"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
