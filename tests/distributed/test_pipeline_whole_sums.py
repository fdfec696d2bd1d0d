"""`parallel.accumulate: whole` in fully sharded pipeline stages (4 gloo ranks, pp 2): each FSDP2 unit's gradients
add up whole over the step's micro-batches and the stage's last backward reduce-scatters the sums, against the
default (a reduce-scatter per micro-batch): losses, gradient norms and parameters within 1e-6 relative (fp32; the
sums only change order) under 1F1B, zero bubble (its W ops' deferred weight gradients held to the step's last W),
GPipe with expert-parallel stages and Pro-Prophet replicas, and planned micro-batches, with migrations between
steps and between a backward pass and its optimizer step; and every reduce-scatter counted."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline_sharded import _rel

STEPS = 6
M = 4
MIGRATE = {"force": ((2, (1, 3)),), "force_mid": ((4, (3, 1)),)}
"""A move after step 2 and one inside step 4, between its backward pass and its optimizer step."""
CASES: dict[str, dict[str, Any]] = {
    "1f1b, dp 2": {"schedule": "1f1b", "migrate": False},
    "zero bubble, dp 2, migrations": {"schedule": "zb", "migrate": True},
    "gpipe, ep 2, replicas, migrations": {"schedule": "gpipe", "ep": 2, "migrate": True},
    "planned micro-batches, dp 2, migrations": {"schedule": "1f1b", "planned": True, "migrate": True},
}


def _cfg(case: dict[str, Any], accumulate: str) -> Any:
    from moebal.config import from_dict

    ep = case.get("ep", 1)
    planned = {"microbatching": "dynamic", "dynamic": {"costs": "a100", "workers": 0}} if case.get("planned") else {}
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        # planned micro-batches: no routing losses, so that `shard: full` alone puts the stage's ranks in lockstep
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop",
                "aux_loss_coef": 0.0 if planned else 0.01},
        "data": {"seq_len": 16, "batch_size": 16, "max_bytes": 200_000},
        "train": {"steps": STEPS, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "grad_clip": 0.5, "threads": 1, "progress": "plain"},
        "parallel": {"pp": 2, "ep": ep, "nproc": 4, "shard": "full", "accumulate": accumulate},
        # a fixed hardware profile and no hysteresis: both runs of a pair place the same replicas
        "planner": {"policy": "broadcast_topk" if ep > 1 else "static", "costs": "rtx3090", "hysteresis": 0.0},
        "pipeline": {"micro_batches": M, "schedule": case["schedule"], **planned},
        "dynamism": {"scheme": "moe" if ep > 1 else "none"}})


def _run(case: dict[str, Any], accumulate: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from moebal.distributed.fsdp import _stage_units
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.planned import PlannedPipelineRunner
    from moebal.pipeline.runner import PipelineRunner

    cfg = _cfg(case, accumulate)
    cls = PlannedPipelineRunner if case.get("planned") else PipelineRunner
    calls = {"n": 0}
    inner = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return inner(*args, **kwargs)

    dist.reduce_scatter_single = counted  # FSDP2, the W ops' reducer and the expert optimizer look it up here
    try:
        runner = cls(cfg, scheme=build_dynamism(cfg.dynamism.scheme, {}, cfg=cfg),
                     **(MIGRATE if case["migrate"] else {}))
        out = runner.train(STEPS)
    finally:
        dist.reduce_scatter_single = inner
    return {"records": out.records, "sizes": out.final_sizes, "params": runner.full_state(), "calls": calls["n"],
            "units": sum(isinstance(m, FSDPModule) for m in _stage_units(runner.stage))}


def _pairs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, case in CASES.items():
        sharded, whole = _run(case, "sharded"), _run(case, "whole")
        p, q = sharded.pop("params"), whole.pop("params")
        out[name] = {"sharded": sharded, "whole": whole,
                     "param_rel": max((_rel(p[n], q[n]) for n in p if p[n].norm() > 0), default=0.0)}
    return out


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return run_ranks(_pairs, 4, timeout_s=900)


@pytest.mark.parametrize("name", list(CASES))
def test_whole_sums_in_pipeline_stages_train_as_per_micro_batch_sums(pairs, name):
    for r in pairs:
        c = r[name]
        sharded, whole = c["sharded"], c["whole"]
        assert [x["step"] for x in whole["records"]] == list(range(1, STEPS + 1))
        for a, b in zip(sharded["records"], whole["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (name, a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6), (name, a["step"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in sharded["records"])  # the clip acted
        assert c["param_rel"] < 1e-6, (name, c["param_rel"])
        assert whole["calls"] < sharded["calls"], (name, whole["calls"], sharded["calls"])
        if CASES[name]["migrate"]:
            assert [x["migration"] for x in whole["records"] if "migration" in x] == ["forced", "forced-mid"]
        else:  # one reduce-scatter per unit and step instead of one per unit and micro-batch
            assert sharded["calls"] - whole["calls"] == STEPS * (M - 1) * whole["units"], (sharded, whole)
