"""Sharded gradients and AdamW state (`parallel.shard: optimizer`) against unsharded training on gloo ranks:
20 steps, losses, gradient norms and parameters within 1e-5 relative (fp32); data parallel, expert parallel,
Pro-Prophet replicas; resume across shard sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

STEPS = 20


def _cfg(shard: str, ep: int | None, policy: str = "static", steps: int = STEPS, **train: Any) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.01},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "ckpt_every": 0, "progress": "plain", "threads": 1, "grad_clip": 0.5, **train},
        "parallel": {"ep": ep, "shard": shard},
        # a fixed hardware profile and no hysteresis: the same plans in every run, and they replicate
        "planner": {"policy": policy, "costs": "rtx3090", "hysteresis": 0.0}})


def _train(cfg: Config, out: Path, resume: bool = False) -> dict[str, Any]:
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    ctx, model, hooks = setup_parallel(cfg, run_dir=out, resume=resume)
    trainer = Trainer(cfg, out, model=model, hooks=hooks, ctx=ctx, resume=resume)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if ctx.is_main else []
    return {"rows": [r for r in rows if "loss" in r], "params": params, "optimizer": type(trainer.optimizer).__name__}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12))


def _pair(rank: int, world: int, root: str, ep: int | None, policy: str) -> dict[str, Any]:
    """Both runs on these ranks; the rows, and the worst relative difference of this rank's parameters (plain
    data: tensors do not cross the result queue)."""
    runs = {shard: _train(_cfg(shard, ep, policy), Path(root) / shard) for shard in ("none", "optimizer")}
    p, s = runs["none"]["params"], runs["optimizer"]["params"]
    assert p.keys() == s.keys()
    assert (runs["none"]["optimizer"], runs["optimizer"]["optimizer"]) == ("AdamW", "ShardedAdamW")
    return {"none": runs["none"]["rows"], "optimizer": runs["optimizer"]["rows"],
            "param_rel": max(_rel(s[n], p[n]) for n in p)}


def _check(out: list[dict[str, Any]]) -> None:
    plain, sharded = out[0]["none"], out[0]["optimizer"]
    assert [r["step"] for r in sharded] == list(range(1, STEPS + 1))
    for a, b in zip(plain, sharded):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])
    assert any(r["grad_norm"] > 0.5 for r in plain)  # the clip acted
    worst = max(r["param_rel"] for r in out)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)])
def test_sharded_optimizer_matches_unsharded_for_20_steps(tmp_path, world, ep):
    _check(run_ranks(_pair, world, str(tmp_path), ep, "static", timeout_s=600))


def test_sharded_optimizer_with_prophet_replicas_matches_unsharded(tmp_path):
    out = run_ranks(_pair, 2, str(tmp_path), 2, "prophet", timeout_s=600)
    assert any(sum(r["replicas"]) > 0 for r in out[0]["optimizer"])  # Trans and Agg ran
    _check(out)


# ---- checkpoints: resume across shard sizes ------------------------------------------------------------------

RESUME_STEPS = 6


def _leg(rank: int, world: int, root: str, shard: str, ep: int | None, resume: bool, stop: int | None) -> list[dict]:
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    cfg = _cfg(shard, ep, steps=RESUME_STEPS, ckpt_every=2)
    out = Path(root)
    ctx, model, hooks = setup_parallel(cfg, run_dir=out, resume=resume)
    trainer = Trainer(cfg, out, model=model, hooks=hooks, ctx=ctx, resume=resume)
    trainer.train(stop_after=stop)
    trainer.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if ctx.is_main else []
    return [r for r in rows if "loss" in r]


def _state(path: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint and its AdamW moments, by name."""
    from moebal.train.checkpoint import read_checkpoint

    out: dict[str, torch.Tensor] = {}
    with read_checkpoint(path) as reader:
        for name in reader.names():
            out[name] = reader.read(name)
        for k in reader.manifest["tensors"]:
            ln, _, key = k.rpartition(":")
            if ln and key != "step":
                out[k] = reader.optimizer_state(ln)[key]
    return out


def test_resume_across_shard_sizes_1_2_4_with_expert_parallelism(tmp_path):
    """One process for 2 steps, then 2 ranks (ep 2: dense state in 2 shards), then 4 ranks (ep 2: dense state in 4
    shards, expert state in 2), against one uninterrupted process: losses, weights and AdamW moments."""
    whole = run_ranks(_leg, 1, str(tmp_path / "whole"), "none", None, False, None, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(_leg, 1, run, "none", None, False, 2, timeout_s=600)
    run_ranks(_leg, 2, run, "optimizer", 2, True, 4, timeout_s=600)
    resumed = run_ranks(_leg, 4, run, "optimizer", 2, True, None, timeout_s=600)[0]
    assert [r["step"] for r in resumed] == list(range(1, RESUME_STEPS + 1))
    for a, b in zip(whole, resumed):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
    ref, got = (_state(Path(d) / f"ckpt-{RESUME_STEPS:07d}") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") for k in ref)
    worst = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    assert worst < 1e-5, worst
    manifest = json.loads((Path(run) / f"ckpt-{RESUME_STEPS:07d}" / "manifest.json").read_text())
    writers = {e["file"] for k, e in manifest["tensors"].items() if ":" in k}
    assert len(writers) == 4, writers  # the AdamW state was written by its owners, every rank a part
