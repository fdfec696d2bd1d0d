"""Lina's inference scheduling while decoding: the MoE layers' time per forward of `moebal generate --nproc R`.

`scripts/bench_lina_inference.py` times whole batches (every token of 8 sequences a rank in one forward). A
KV-cached decode step sends each MoE layer one token a sequence, so a rank's experts see a few rows each. Under
the default least share (`--min-rows 64`, `MIN_ROWS`) such a layer's assignments fill no group of 64 rows, so
every policy runs it on the static blocks, unplanned and unpadded (`LinaDispatcher._unsplittable`,
moebal/distributed/lina_inference.py); under the thesis's allocation (`--min-rows 0`) the policies plan it and
the expert loop pads each group to `MIN_ROWS` rows, where an expert's cost hardly depends on how many rows it
receives. This script measures what the policies do there, on
the same served model as that benchmark (`SERVED`, top-1, the same skew and expert padding), through
`expert_parallel_generate` (moebal/distributed/ep_generate.py), the code `moebal generate --nproc R --policy P`
runs.

Per round, one generation of the same prompts under every policy on `--ranks` gloo ranks, the policies in an
order rotated per round (`--rounds`, default 6: a round's figures move by 10-20 % with the host), after one
untimed generation of the round's first batch (`warmup`: the fresh ranks' first forwards weigh on no policy):
`--prompts-per-rank` prompts of `--prompt-len` validation tokens a rank, `--new-tokens` new tokens each, greedy,
KV-cached. A forward's MoE time is the sum over the MoE layers
of the slowest rank's time in the layer (planning, the count exchange, both all-to-alls, the experts).
Reported per policy: each round's median over the decode steps (and the prompts' forward, apart), the median
over rounds, and static's over each policy's; whether its tokens equal static's (they must: the run fails
otherwise).

`--min-rows 64 0` runs each round twice, the default and the thesis's allocation (replicas at any size;
docs/expert-parallel.md, "A holder's least share"), in an order rotated per round: one record per value under
`by_min_rows`.

Usage: python scripts/bench_lina_decode.py [RUN_DIR] [--ranks 2] [--width 1024] [--min-rows 64 0] [--quick]
           [--json OUT]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from moebal.data import eval_batches
from moebal.distributed.ep_generate import expert_parallel_generate
from moebal.distributed.lina_inference import LAYER_PARTS, MIN_ROWS
from moebal.models.generate import Sampling
from moebal.planner.paths import build_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lina_inference as whole  # noqa: E402  (the whole-batch benchmark: its served model, skew and padding)

POLICIES, SERVED = whole.POLICIES, whole.SERVED


def decode_round(model: Any, prompts: list[list[int]], ranks: int, new_tokens: int, order: list[str],
                 profile: Any, min_rows: int = MIN_ROWS) -> dict[str, Any]:
    """One generation of `prompts` under each policy of `order` (in that order): per policy, the MoE time of
    the prompts' forward and the decode steps' median, the decode steps' median of each part of it (the slowest
    rank's experts, planning and exchanges: `slowest_rank_parts`), and its tokens."""
    res = expert_parallel_generate(model, prompts, ranks, new_tokens, Sampling(), batch_size=len(prompts),
                                   policies=order, profile=profile, timeout_s=3600, min_rows=min_rows,
                                   warmup=True)
    step_rows = len(prompts) * next(iter(model.moe_layers())).top_k  # a decode step: one token a prompt
    out: dict[str, Any] = {}
    for policy, r in res.items():
        decode = [s for s, rows in zip(r.moe_s, r.rows) if rows <= step_rows]
        prompt = [s for s, rows in zip(r.moe_s, r.rows) if rows > step_rows]
        steps = [parts for parts, rows in zip(r.parts, r.rows) if rows <= step_rows]
        out[policy] = {"decode_moe_s": statistics.median(decode), "prompt_moe_s": statistics.median(prompt),
                       "decode_steps": len(decode), "replicas": r.replicas, "replans": r.replans,
                       "decode_parts_s": {k: statistics.median(p[k] for p in steps) for k in LAYER_PARTS},
                       "tokens": [g.tokens for g in r.generations]}
    return out


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: every round's figures, their medians, static's median over the policy's."""
    summ: dict[str, Any] = {}
    for policy in POLICIES:
        per = [r[policy] for r in rounds]
        summ[policy] = {k: [p[k] for p in per] for k in ("decode_moe_s", "prompt_moe_s", "replicas", "replans")}
        summ[policy]["decode_moe_s_median"] = statistics.median(summ[policy]["decode_moe_s"])
        summ[policy]["prompt_moe_s_median"] = statistics.median(summ[policy]["prompt_moe_s"])
        summ[policy]["decode_parts_s_median"] = {k: statistics.median(p["decode_parts_s"][k] for p in per)
                                                 for k in LAYER_PARTS}
        summ[policy]["equal_static"] = all(r[policy]["tokens"] == r["static"]["tokens"] for r in rounds)
    for policy in POLICIES:
        for part in ("decode", "prompt"):
            summ[policy][f"static_over_this_{part}"] = (summ["static"][f"{part}_moe_s_median"]
                                                        / summ[policy][f"{part}_moe_s_median"])
    return summ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", help="a `moebal train` run to serve (default: train `SERVED` first)")
    ap.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks (they must divide the experts)")
    ap.add_argument("--skew", type=float, default=4.0, help="busiest expert / mean load to fit (0: the model's own)")
    ap.add_argument("--width", type=int, default=1024, help="expert hidden width after padding")
    ap.add_argument("--prompts-per-rank", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 32; quick: 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds, policies rotated (default 6; quick: 1)")
    ap.add_argument("--profile-batches", type=int, default=16, help="training batches the path profile is built on")
    ap.add_argument("--path-len", type=int, default=3)
    ap.add_argument("--min-rows", type=int, nargs="+", default=[MIN_ROWS],
                    help=f"a holder's least share of an expert's rows, each a run per round, rotated (default "
                         f"{MIN_ROWS}, the dispatcher's padded group; 0: the thesis's allocation, replicas at any "
                         f"size)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 4 new tokens, 60 training steps")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="steps of the served model's training without RUN_DIR (default 300; quick: 60)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name, default, quick in (("new_tokens", 32, 4), ("rounds", 6, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    for name in ("ranks", "width", "prompts_per_rank", "prompt_len", "new_tokens", "rounds", "profile_batches",
                 "path_len", "train_steps"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            ap.error(f"--{name.replace('_', '-')} takes a positive value; got {v}")
    for name in ("new_tokens", "prompt_len"):  # a decode step to time; a prompt's forward apart from the steps'
        if getattr(args, name) < 2:
            ap.error(f"--{name.replace('_', '-')} must be at least 2; got {getattr(args, name)}")
    if min(args.min_rows) < 0 or len(set(args.min_rows)) < len(args.min_rows):
        ap.error(f"--min-rows takes distinct values of 0 (the thesis's allocation) or more; got {args.min_rows}")
    if not args.run_dir:
        whole._check_width(args.width, int(dict(o.split("=") for o in SERVED)["moe.expert_ffn_dim"]))
    return whole.serve_and_record(args, measure)


def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The whole benchmark on the served model of `run_dir` (module docstring)."""
    served = whole.skewed_model(run_dir, args.skew, args.profile_batches)
    cfg, model, data, prof_batches, s = served.cfg, served.model, served.data, served.prof_batches, served.bias_strength
    E = cfg.moe.num_experts
    if E % args.ranks:
        raise SystemExit(f"--ranks {args.ranks} does not divide the served model's {E} experts")
    if args.prompt_len > cfg.data.seq_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} is longer than the served model's sequences "
                         f"({cfg.data.seq_len})")
    whole._check_width(args.width, whole.model_width(model))
    pad_diff = served.pad(args.width)
    profile = build_profile(whole._routing(model, prof_batches), E, args.path_len)
    n = args.ranks * args.prompts_per_rank
    val = eval_batches(data.corpus.val, cfg.data.samples, cfg.data.seq_len, n, 1)
    prompts = [row[:args.prompt_len].tolist() for row in val[0].ids_BT][:n]
    if len(prompts) < n:
        raise SystemExit(f"the validation split gave {len(prompts)} sequences; {n} prompts are needed")
    orders = [POLICIES[i % 4:] + POLICIES[:i % 4] for i in range(args.rounds)]
    settings = args.min_rows
    rounds: dict[int, list[dict[str, Any]]] = {m: [] for m in settings}
    for i, order in enumerate(orders):
        for m in settings[i % len(settings):] + settings[:i % len(settings)]:  # the settings rotated too
            rounds[m].append(decode_round(model, prompts, args.ranks, args.new_tokens, order, profile, m))
            print(f"round {i + 1}, min_rows {m} ({', '.join(order)}): decode step MoE time (ms) " + ", ".join(
                f"{p} {rounds[m][-1][p]['decode_moe_s'] * 1e3:.2f}" for p in POLICIES) + "; prompts' forward "
                + ", ".join(f"{p} {rounds[m][-1][p]['prompt_moe_s'] * 1e3:.1f}" for p in POLICIES), flush=True)
    by_min_rows = {}
    for m in settings:
        summ = summarise(rounds[m])
        if not all(summ[p]["equal_static"] for p in POLICIES):
            raise SystemExit(f"min_rows {m}: a policy's tokens differ from static's: " + ", ".join(
                p for p in POLICIES if not summ[p]["equal_static"]))
        print(f"min_rows {m}, medians over rounds, static / policy: decode " + ", ".join(
            f"{p} {summ[p]['static_over_this_decode']:.2f}" for p in POLICIES[1:]) + "; prompts' forward "
            + ", ".join(f"{p} {summ[p]['static_over_this_prompt']:.2f}" for p in POLICIES[1:])
            + "; replicas " + ", ".join(f"{p} {statistics.median(summ[p]['replicas']):g}" for p in POLICIES[1:])
            + "; tokens equal static: True")
        print(f"min_rows {m}, a decode step's MoE time (ms, medians over rounds; the slowest rank's parts): "
              + "; ".join(
            f"{p} " + ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in summ[p]["decode_parts_s_median"].items())
            for p in POLICIES))
        by_min_rows[str(m)] = summ
    return {"machine": f"{platform.machine()}, torch {torch.__version__}, gloo",
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")},
            "bias_strength": s, "num_experts": E, "moe_layers": sum(1 for _ in model.moe_layers()), "top_k": 1,
            "padding_max_logit_diff": pad_diff,
            "skew_profile_batches": whole._skew(whole._routing(model, prof_batches[:4]), E),
            "policy_order_per_round": orders, "by_min_rows": by_min_rows}

if __name__ == "__main__":
    sys.exit(main())
