"""Model-state memory per rank under `parallel.shard` none / optimizer / full, measured on real gloo ranks.

    python scripts/bench_shard_memory.py [--ranks 4] [--steps 3] [--shards none optimizer optimizer_bf16 full full_bf16]
        [--json FILE]

For each layout (`LAYOUTS`: data parallel; 2 x 2 data x expert parallel; 4-way expert parallel) and each shard
value, the trainer runs `--steps` steps on `--ranks` gloo ranks and every rank sums, from the tensors' storages
(each storage once), the bytes of its parameters, gradients, persistent gradient buffers and optimizer state
(`moebal.distributed.sharded.model_state_bytes`) at four points of every step:
  forward    inside the last decoder layer's forward, ahead of its expert computation (under full: the root's
             and this layer's dense weights all-gathered beside every shard, FSDP2's sharded storage counted too;
             with ep 2 x dp 2 the layer's expert weights gathered beside the parts kept at rest)
  backward   right after the backward pass (a hook ahead of the gradient synchronisation)
  update     just before the optimizer step (the reduced gradients held, moments allocated)
  rest       after the step (between steps: what a run holds all the time)
`peak` is the largest of the four. The figures are bytes, exact and deterministic (no repeats needed); the
JSON has every rank's samples, the ratios sharded / unsharded of the worst rank, the config and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from moebal.commands.bench import at_least
from moebal.config import Config, from_dict, to_dict
from moebal.distributed.testing import run_ranks
from moebal.train.hooks import Hook

LAYOUTS = {"dp": 1, "dp2_x_ep2": 2, "ep4": 4}
"""parallel.ep of each layout on 4 ranks: experts replicated (their state sharded 4 ways with the dense state);
2 expert-parallel x 2 data-parallel (expert state 2 ways); experts sharded 4 ways (expert state not sharded: each
expert has one copy, so no expert-data-parallel ranks to split it over)."""


SHARDS = ("none", "optimizer", "optimizer_bf16", "full", "full_bf16")
"""`optimizer_bf16`: `shard: optimizer` with `parallel.param_dtype: bf16` (bf16 weights for compute, fp32 masters
sharded with the moments; the expert-parallel experts' too where two ranks or more hold each expert shard) under
bf16 autocast; `full_bf16`: `shard: full` with it (FSDP2 gathers the dense weights in bf16; the expert weights at
rest are gathered in bf16 from fp32 parts). Their ratio is against the fp32 `none` run, the accounting of
ZeRO's mixed-precision baseline (16 bytes a parameter either way: fp32 weights, gradients and two moments)."""


def bench_config(shard: str, ep: int | None, steps: int) -> Config:
    shard, _, dtype = shard.partition("_")
    return from_dict({
        "model": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256, "max_seq_len": 64,
                  "vocab_size": 512},
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 128, "kernel": "loop"},
        "data": {"seq_len": 32, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 0, "eval_every": 0, "precision": dtype or "fp32", "ckpt_every": 0,
                  "progress": "plain", "threads": 1},
        "parallel": {"ep": ep, "shard": shard, "param_dtype": dtype or "fp32"},
        "planner": {"policy": "static", "costs": "rtx3090"}})


class _Probe(Hook):
    """Samples model-state bytes after the backward pass (ahead of every other hook) and after the step."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self.trainer: Any = None

    @property
    def name(self) -> str:
        return "memory_probe"

    def sample(self, point: str, step: int) -> None:
        from moebal.distributed.expert_parallel import ExpertParallel
        from moebal.distributed.sharded import model_state_bytes

        t = self.trainer
        bufs: list[torch.Tensor] = []
        for h in t.hooks:
            ep = getattr(h, "ep", None)
            if isinstance(ep, ExpertParallel) and ep.grads is not None:
                bufs.extend(ep.grads.bufs)
        self.samples.append({"step": step, "point": point,
                             **model_state_bytes(t.model, t.optimizer, bufs, fsdp_shards(t.model))})

    def watch_forward(self, model: torch.nn.Module) -> None:
        """The "forward" sample: inside the last decoder layer's MoE/MLP part, ahead of its expert computation
        (under expert parallelism as the dispatcher takes the experts' weights: gathered when sharded at rest)."""
        from moebal.distributed.expert_parallel import ExpertParallelDispatcher
        from moebal.models.transformer import DecoderLayer

        last = [m for m in model.modules() if isinstance(m, DecoderLayer)][-1]
        d = getattr(last.ffn, "dispatcher", None)
        if not isinstance(d, ExpertParallelDispatcher):
            last.ffn.register_forward_pre_hook(
                lambda *_: self.sample("forward", self.trainer.step + 1) if torch.is_grad_enabled() else None)
            return
        take = d._local_weights

        def local_weights(local: list[int]) -> Any:
            if torch.is_grad_enabled():
                self.sample("forward", self.trainer.step + 1)
            return take(local)

        d._local_weights = local_weights  # type: ignore[method-assign]

    def after_backward(self, trainer: Any, step: int) -> None:
        self.sample("backward", step)

    def after_step(self, trainer: Any, step: int, stats: Any, record: dict[str, Any]) -> None:
        self.sample("rest", step)


def fsdp_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """The sharded storage of every FSDP2 parameter (`parallel.shard: full`): while a unit is gathered the module
    lists its unsharded weights, and the shards stay allocated beside them. Reads FSDP2's per-parameter state
    (`_sharded_param_data`, torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(fp._sharded_param_data for fp in group.fsdp_params)
    return out


def _run(rank: int, world: int, root: str, layout: str, shard: str, steps: int) -> dict[str, Any]:
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    cfg = bench_config(shard, LAYOUTS[layout], steps)
    out = Path(root) / f"{layout}-{shard}"
    ctx, model, hooks = setup_parallel(cfg, run_dir=out)
    probe = _Probe()
    trainer = Trainer(cfg, out, model=model, hooks=[probe, *hooks], ctx=ctx)
    probe.trainer = trainer
    probe.watch_forward(trainer.model)
    opt = trainer.optimizer
    assert opt is not None
    step_fn = opt.step

    def step(*a: Any, **k: Any) -> Any:
        probe.sample("update", trainer.step + 1)
        return step_fn(*a, **k)

    opt.step = step  # type: ignore[method-assign]
    trainer.train()
    trainer.close()
    n = sum(p.numel() for p in trainer.model.parameters())
    return {"rank": rank, "param_elems": n, "optimizer": type(opt).__name__, "samples": probe.samples}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per run: the worst rank's bytes at each point and at the peak; per layout: sharded / unsharded."""
    out: dict[str, Any] = {}
    for key, ranks in runs.items():
        worst: dict[str, int] = {}
        for r in ranks:
            for s in r["samples"]:
                worst[s["point"]] = max(worst.get(s["point"], 0), s["total"])
        worst["peak"] = max(worst.values())
        out[key] = worst
    for layout in LAYOUTS:
        a = out.get(f"{layout}-none")
        for shard in SHARDS[1:]:
            b = out.get(f"{layout}-{shard}")
            if a and b:
                out[f"{layout}-ratio-{shard}"] = {k: round(b[k] / a[k], 4) for k in a}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=at_least(1), default=4)
    ap.add_argument("--steps", type=at_least(1), default=3)
    ap.add_argument("--shards", nargs="+", default=list(SHARDS), choices=SHARDS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import tempfile

    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for layout in LAYOUTS:
            for shard in args.shards:
                runs[f"{layout}-{shard}"] = run_ranks(_run, args.ranks, root, layout, shard, args.steps,
                                                      timeout_s=900)
    summary = summarise(runs)
    result = {"ranks": args.ranks, "steps": args.steps, "shards": args.shards, "summary": summary, "runs": runs,
              "config": {layout: to_dict(bench_config("optimizer", ep, args.steps)) for layout, ep in LAYOUTS.items()},
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "backend": "gloo"}}
    for key, v in summary.items():
        print(key, json.dumps(v))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
