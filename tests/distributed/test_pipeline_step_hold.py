"""What FSDP2 holds through a step in fully sharded pipeline stages (4 gloo ranks, pp 2): whole gradient sums
(`parallel.accumulate: whole`: each unit's gradients add up over the step's micro-batches and the stage's last
backward reduce-scatters them) and weights gathered once per step (`parallel.reshard: step`), against the default
(a reduce-scatter per micro-batch, an all-gather per forward and per backward pass): losses, gradient norms and
parameters within 1e-6 relative (fp32; the sums only change order) under 1F1B, zero bubble (its W ops' deferred
weight gradients held to the step's last W), GPipe with expert-parallel stages and Pro-Prophet replicas, and
planned micro-batches, with migrations between steps and between a backward pass and its optimizer step; every
reduce-scatter and all-gather counted."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import counting_collectives
from tests.distributed.test_pipeline_sharded import _rel

STEPS = 6
M = 4
MIGRATE = {"force": ((2, (1, 3)),), "force_mid": ((4, (3, 1)),)}
"""A move after step 2 and one inside step 4, between its backward pass and its optimizer step."""
WHOLE, STEP = {"accumulate": "whole"}, {"reshard": "step"}
CASES: dict[str, dict[str, Any]] = {
    "1f1b, dp 2, whole sums": {"schedule": "1f1b", "migrate": False, "hold": WHOLE},
    "1f1b, dp 2, weights per step": {"schedule": "1f1b", "migrate": False, "hold": STEP},
    "zero bubble, dp 2, whole sums, migrations": {"schedule": "zb", "migrate": True, "hold": WHOLE},
    "gpipe, ep 2, replicas, both, migrations": {"schedule": "gpipe", "ep": 2, "migrate": True,
                                                "hold": {**WHOLE, **STEP}},
    "planned micro-batches, dp 2, both, migrations": {"schedule": "1f1b", "planned": True, "migrate": True,
                                                      "hold": {**WHOLE, **STEP}},
    # some tokens leave after layer 1, all after layer 2: layers that a micro-batch skips keep their weights
    # gathered from an earlier one until the step ends (whole sums are refused with early exit)
    "1f1b, dp 2, early exit, weights per step, migrations": {
        "schedule": "1f1b", "migrate": True, "hold": STEP,
        "dynamism": {"scheme": "early_exit", "early_exit": {"threshold": 0.9, "first_layer": 1}}},
}


def _cfg(case: dict[str, Any], hold: dict[str, str]) -> Any:
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
        "parallel": {"pp": 2, "ep": ep, "nproc": 4, "shard": "full", **hold},
        # a fixed hardware profile and no hysteresis: both runs of a pair place the same replicas
        "planner": {"policy": "broadcast_topk" if ep > 1 else "static", "costs": "rtx3090", "hysteresis": 0.0},
        "pipeline": {"micro_batches": M, "schedule": case["schedule"], **planned},
        "dynamism": case.get("dynamism", {"scheme": "moe" if ep > 1 else "none"})})


def _run(case: dict[str, Any], hold: dict[str, str]) -> dict[str, Any]:
    from moebal.distributed.fsdp import stage_units
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.planned import PlannedPipelineRunner
    from moebal.pipeline.runner import PipelineRunner

    cfg = _cfg(case, hold)
    cls = PlannedPipelineRunner if case.get("planned") else PipelineRunner
    with counting_collectives() as calls:
        runner = cls(cfg, scheme=build_dynamism(cfg.dynamism.scheme, {}, cfg=cfg),
                     **(MIGRATE if case["migrate"] else {}))
        out = runner.train(STEPS)
    return {"records": out.records, "sizes": out.final_sizes, "params": runner.full_state(), "calls": dict(calls),
            "units": len(stage_units(runner.stage))}


def _pairs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for name, case in CASES.items():
        default, held = _run(case, {}), _run(case, case["hold"])
        p, q = default.pop("params"), held.pop("params")
        out[name] = {"default": default, "held": held,
                     "param_rel": max((_rel(p[n], q[n]) for n in p if p[n].norm() > 0), default=0.0)}
    return out


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return run_ranks(_pairs, 4, timeout_s=900)


@pytest.mark.parametrize("name", list(CASES))
def test_what_fsdp2_holds_through_a_step_in_pipeline_stages_changes_its_traffic_not_the_training(pairs, name):
    for r in pairs:
        c = r[name]
        default, held = c["default"], c["held"]
        assert [x["step"] for x in held["records"]] == list(range(1, STEPS + 1))
        for a, b in zip(default["records"], held["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (name, a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6), (name, a["step"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in default["records"])  # the clip acted
        assert c["param_rel"] < 1e-6, (name, c["param_rel"])
        hold = CASES[name]["hold"]
        saved = {op: default["calls"][op] - held["calls"][op] for op in default["calls"]}
        assert saved["reduce_scatter_single"] > 0 if "accumulate" in hold else saved["reduce_scatter_single"] == 0
        assert saved["all_gather_single"] > 0 if "reshard" in hold else saved["all_gather_single"] == 0
        if CASES[name]["migrate"]:
            assert [x["migration"] for x in held["records"] if "migration" in x] == ["forced", "forced-mid"]
        elif "accumulate" in hold:  # one reduce-scatter per unit and step instead of one per unit and micro-batch
            assert saved["reduce_scatter_single"] == STEPS * (M - 1) * held["units"], (name, saved)
        else:  # one all-gather per unit and step instead of one per forward and one per backward pass
            assert saved["all_gather_single"] == STEPS * (2 * M - 1) * held["units"], (name, saved)


def _hold_of_a_unit_without_backward(rank: int, world: int) -> dict[str, bool]:
    """Two FSDP2 units under `reshard: step`: one runs a forward and no backward (a layer the step's last
    micro-batch skips); `end` frees its gathered weights, so the next step gathers the updated shards."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from moebal.config import from_dict
    from moebal.distributed.fsdp import StepHold, fsdp_units

    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for m in (a, b):
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
    hold = StepHold.of(from_dict({"parallel": {"shard": "full", "reshard": "step"}}),
                       lambda: fsdp_units(a) + fsdp_units(b), lambda m: True)
    assert hold is not None
    out: dict[str, bool] = {}
    with hold.step():
        x = torch.randn(2, 8)
        a(x).sum().backward()
        with torch.no_grad():
            b(x)  # forward only: nothing but `end` frees it
        out["kept_after_forward"] = not isinstance(b.weight, DTensor)
    out["sharded_after_end"] = isinstance(a.weight, DTensor) and isinstance(b.weight, DTensor)
    b(x)  # and outside a hold it reshards after its forward again, as built
    out["reshards_after_forward_again"] = isinstance(b.weight, DTensor)
    return out


def test_a_step_hold_frees_what_no_backward_freed_and_restores_the_construction_time_resharding():
    for r in run_ranks(_hold_of_a_unit_without_backward, 2, timeout_s=300):
        assert r == {"kept_after_forward": True, "sharded_after_end": True, "reshards_after_forward_again": True}
