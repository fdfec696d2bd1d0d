"""Expert-parallel training step time under placement policies, real gloo ranks on this machine.

For each world size (2 ranks x 1 thread; 4 as well without --quick) one job trains an MoE-heavy model and,
interleaved in rounds, runs a few steps of every (routing, policy) pair:

  routing   balanced (the router as trained), skewed (a selection bias -s*log(expert id + 1) that makes the
            busiest expert's load at least 3x the mean), recorded (the per-expert shares of a real run's
            metrics.jsonl, reproduced with a selection bias; skipped without --recorded RUN_DIR)
  method    placement policies on moebal's executor (its all-to-all, Trans and Agg): static (plain expert
            parallelism), fastermoe-policy (FasterMoE's dynamic shadowing policy; not FasterMoE's system: no smart
            schedule, no FastMoE kernels), prophet (Pro-Prophet greedy, open loop: every plan applied),
            prophet+feedback (the `ExpertBalancer` as training runs it with `planner.feedback.enabled`: Pro-Prophet
            placement or static placement, as the measured step times say; one balancer per routing for the
            whole run, first settled in by 1 + 2 x window untimed steps, the loop's first trial), plan-ahead
            (`planner.plan_ahead: path`: the MoE layers from l = --path-len on planned during the layer before
            them from the tokens' sample paths, Trans issued before their gate; the others as prophet; the path
            profile built online from the run's own routing, one per routing for the whole run, first settled in
            by --path-settle untimed steps; its records carry the prediction accuracy the plans ran with, against
            the previous-iteration forecast on the same steps); and, when
            `tutel` is importable, tutel: the same model with every MoE block replaced by Tutel's dropless
            `moe_layer` (SwiGLU expert, the block's router and experts loaded, Tutel's own all-to-all)

Each moebal step = plan from the previous step's all-gathered counts, Trans, forward, backward, Agg, gradient
sync, optimizer step; a Tutel step = forward, backward, gradient sync (dense gradients averaged in one
all-reduce), optimizer step. The step time is the slowest rank's. Every round runs every (routing, method)
pair, the order of both rotated by one each round. The planner's coefficients are measured on the job itself
at start-up (moebal.distributed.calibrate). `--load N` keeps N busy processes (one spinning Python loop each)
running for the whole run, calibration included: a machine shared with other jobs.

    python scripts/bench_expert_parallel.py [--quick] [--load N] [--rounds R --steps S --warmup W] [--json FILE]
                                           [--png FILE] [--recorded RUN_DIR] [--methods M ...] [--path-len L]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moebal.balance.experts import ExpertBalancer
from moebal.commands import third_party as tp
from moebal.commands.bench import add_device_argument, at_least, script_device
from moebal.config import Config, from_dict, to_dict
from moebal.distributed.calibrate import describe, measure_layer_costs
from moebal.distributed.expert_parallel import ExpertParallel
from moebal.distributed.groups import ParallelDims
from moebal.distributed.plan_ahead import PlanAhead
from moebal.distributed.testing import run_ranks
from moebal.models import build_model
from moebal.planner.perf import MoELayerCosts
from moebal.planner.placement import ExpertPlanner, placement_metrics, plan_experts
from moebal.planner.plan import ExpertPlacement

CPU_ONLY = "it times gloo ranks on this machine's cores"
"""Why `--device` accepts cpu only here."""

POLICIES = ("static", "fastermoe", "prophet")
FEEDBACK = "prophet+feedback"
AHEAD = "plan-ahead"
TUTEL = "tutel"
METHODS = (*POLICIES, FEEDBACK, AHEAD, TUTEL)
LABELS = {"static": "static", "fastermoe": "fastermoe-policy", "prophet": "prophet", FEEDBACK: FEEDBACK,
          AHEAD: AHEAD, TUTEL: "tutel"}
"""How the table and the chart name each method ("fastermoe" is the policy's name in moebal's planner)."""
NOTES = {
    "static": "placement policy on moebal's executor: every expert on its owner",
    "fastermoe": "FasterMoE's dynamic shadowing placement policy on moebal's executor (moebal's all-to-all, Trans "
                 "and Agg); not FasterMoE's system: no smart schedule, no FastMoE kernels",
    "prophet": "Pro-Prophet's greedy placement policy on moebal's executor, open loop (every plan applied)",
    FEEDBACK: "the ExpertBalancer with its loop closed (planner.feedback defaults, enabled): Pro-Prophet's placement "
              "or static placement as the measured step times say; one balancer per routing for the whole run",
    AHEAD: "planner.plan_ahead: path on moebal's executor: MoE layers from --path-len on planned (Pro-Prophet's "
           "greedy) during the layer before them from the sample-path estimate, Trans issued before their gate; "
           "the earlier layers as prophet; online path profile",
    TUTEL: "Tutel's dropless moe_layer (llama_ffn SwiGLU expert, explicit silu) with its own all-to-all, the "
           "moebal block's router and experts loaded; the routing bias is added to its logits (same expert "
           "choice as moebal's choice-only bias; its combine weights see the bias too)",
}
LEGEND = ("static, fastermoe-policy, prophet: placement policies on moebal's executor (fastermoe-policy is "
          "FasterMoE's shadowing policy, not FasterMoE's system); prophet+feedback: Pro-Prophet with the closed "
          "loop (moebal.balance.experts); tutel: Tutel's moe_layer and all-to-all")


def bench_config(quick: bool) -> Config:
    """MoE-heavy: expert compute is most of the step, as in real MoE training."""
    return from_dict({
        "name": "bench-expert-parallel",
        "model": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 1024, "max_seq_len": 128},
        "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_dim": 1024, "aux_loss_coef": 0.0},
        "data": {"seq_len": 128, "batch_size": 8},
        "train": {"precision": "fp32"},
    })


def skew_bias(E: int, strength: float) -> torch.Tensor:
    return -strength * torch.log(torch.arange(1, E + 1, dtype=torch.float32))


def recorded_bias(shares: list[float]) -> torch.Tensor:
    """A selection bias whose softmax reproduces the recorded per-expert shares (logits = log share)."""
    s = np.clip(np.asarray(shares, dtype=np.float64), 1e-6, None)
    return torch.tensor(np.log(s / s.sum()), dtype=torch.float32)


def _set_bias(model: torch.nn.Module, bias: torch.Tensor | None) -> None:
    for layer in model.moe_layers():
        layer.expert_bias = None if bias is None else bias.clone()


def _step(model, ep: ExpertParallel, opt, ids: torch.Tensor, placements: list[ExpertPlacement]) -> list[np.ndarray]:
    ep.apply(placements)
    out = model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    ep.aggregate()
    ep.sync_gradients()
    opt.step()
    opt.zero_grad(set_to_none=True)
    counts = []
    for layer in model.moe_layers():
        local = layer.last_stats.counts_E.clone()
        gathered = [torch.zeros_like(local) for _ in range(ep.dims.size("ep"))]
        dist.all_gather(gathered, local, group=ep.dims.group("ep"))
        counts.append(torch.stack(gathered).numpy().astype(np.float64))
    return counts


def _worker(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    cfg = from_dict(spec["config"])
    torch.manual_seed(0)
    model = build_model(cfg)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    ep = ExpertParallel(model, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(1234 + rank)
    costs = measure_layer_costs(ep.dispatchers[0], B * T * cfg.moe.top_k)
    routings = {"balanced": None, "skewed": skew_bias(cfg.moe.num_experts, spec["skew"])}
    if spec.get("recorded_shares"):
        routings["recorded"] = recorded_bias(spec["recorded_shares"])
    tutel, tutel_failed = _tutel_job(cfg, rank, world) if spec.get("tutel") else (None, None)
    if spec.get("tutel"):  # every rank must agree, or the others would wait in Tutel's all-to-all
        built = torch.tensor([0 if tutel is None else 1])
        dist.all_reduce(built, op=dist.ReduceOp.MIN)
        if not built.item() and tutel is not None:
            tutel, tutel_failed = None, "construction: failed on another rank (its traceback is not gathered)"
    methods = [*spec.get("policies", (*POLICIES, FEEDBACK, AHEAD)), *([TUTEL] if tutel is not None else [])]
    loops = {routing: _Loop(cfg, ep, costs) for routing in routings} if FEEDBACK in methods else {}
    for routing, loop in loops.items():  # the loop's first trial: base window, then plan window, judged
        _set_bias(model, routings[routing])
        _run_loop(model, ep, opt, loop, spec["settle"], cfg, gen, costs, 0)
    aheads = {routing: _ahead(cfg, ep, costs, spec) for routing in routings} if AHEAD in methods else {}
    for routing, ahead in aheads.items():  # the online profile's first builds
        _set_bias(model, routings[routing])
        _run_ahead(model, ep, opt, ahead, costs, {**spec, "warmup": spec["path_settle"], "steps": 0}, cfg, gen)
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(spec["rounds"]):
        for routing in _rotated(list(routings), r):
            for method in _rotated(methods, r):
                key = (routing, method)
                if method == TUTEL:
                    _set_bias(tutel.model, routings[routing])
                    got = _run_tutel(tutel, spec, cfg, gen, world)
                elif method == AHEAD:
                    _set_bias(model, routings[routing])
                    got = _run_ahead(model, ep, opt, aheads[routing], costs, spec, cfg, gen)
                elif method == FEEDBACK:
                    _set_bias(model, routings[routing])
                    got = _run_loop(model, ep, opt, loops[routing], spec["warmup"] + spec["steps"], cfg, gen, costs,
                                    spec["warmup"])
                else:
                    _set_bias(model, routings[routing])
                    got = _run_policy(model, ep, opt, method, costs, spec, cfg, gen)
                samples.setdefault(key, []).extend(dict(x, round=r) for x in got)
    if rank:
        return []
    records = [_tutel_record(routing, world, s, tutel.provenance) if method == TUTEL
               else _record(routing, method, world, s, costs, cfg) for (routing, method), s in samples.items()]
    for rec in records:
        if rec["policy"] == FEEDBACK:
            rec["feedback_decisions"] = loops[rec["routing"]].decisions
    _round_ratios(records)
    if tutel_failed:
        records.append({"policy": TUTEL, "executor": TUTEL, "world_size": world, "failed": tutel_failed,
                        "note": NOTES[TUTEL]})
    return records


def _round_ratios(records: list[dict[str, Any]]) -> None:
    """Each record's median over the rounds of its round median / static's round median (same routing and
    round): steps compared with those of the same round, close in time, which a changing load needs; plan-ahead's
    also against prophet's."""
    for ref in ("static", "prophet"):
        base_of = {r["routing"]: r["round_medians_s"] for r in records if r["policy"] == ref}
        for r in records:
            base = base_of.get(r["routing"])
            if ref == "prophet" and r["policy"] != AHEAD:
                continue
            if base and r["policy"] != ref and len(r.get("round_medians_s", [])) == len(base):
                r[f"median_round_ratio_to_{ref}"] = statistics.median(
                    a / b for a, b in zip(r["round_medians_s"], base))


def _rotated(items: list[str], r: int) -> list[str]:
    """`items` starting at position r (mod its length): each round starts with another variant, so slow drifts
    of a shared machine do not always fall on the same one."""
    k = r % len(items)
    return items[k:] + items[:k]


def _run_policy(model: torch.nn.Module, ep: ExpertParallel, opt: torch.optim.Optimizer, policy: str,
                costs: MoELayerCosts, spec: dict[str, Any], cfg: Config, gen: torch.Generator
                ) -> list[dict[str, Any]]:
    """Warm-up and timed steps of one placement policy on moebal's executor (fresh planners each time)."""
    L, E, world = cfg.model.n_layers, cfg.moe.num_experts, ep.dims.size("ep")
    B, T = cfg.data.batch_size, cfg.data.seq_len
    planners = [ExpertPlanner(E, world, policy, costs, hysteresis=cfg.planner.hysteresis) for _ in range(L)]
    placements = [p.current for p in planners]
    out = []
    for i in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        counts = _step(model, ep, opt, ids, placements)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        t1 = time.perf_counter()
        used = placements
        placements = [p.step(c) for p, c in zip(planners, counts)]
        plan_s = time.perf_counter() - t1
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= spec["warmup"]:
            out.append(_sample(dt.item() + plan_s, plan_s, counts, used, costs))
    return out


def _ahead(cfg: Config, ep: ExpertParallel, costs: MoELayerCosts, spec: dict[str, Any]) -> PlanAhead:
    """One routing's plan-ahead planner (online profile), kept for the whole run."""
    E, world = cfg.moe.num_experts, ep.dims.size("ep")
    owner = ExpertPlacement.static(E, world).owner
    return PlanAhead(len(ep.layers), E, spec["path_len"],
                     lambda j, est_RE: plan_experts(est_RE, "prophet", costs, owner), ep.dims.device, None,
                     refresh=spec["path_refresh"], window=spec["path_window"])


def _run_ahead(model: torch.nn.Module, ep: ExpertParallel, opt: torch.optim.Optimizer, ahead: PlanAhead,
               costs: MoELayerCosts, spec: dict[str, Any], cfg: Config, gen: torch.Generator) -> list[dict[str, Any]]:
    """Warm-up and timed steps of plan-ahead: the ahead layers planned inside the step (their planning and the
    online profile's bookkeeping timed with it), the other layers by fresh Pro-Prophet planners as in
    `_run_policy`; each sample carries the accuracy of the path estimate and of the previous-iteration forecast
    on the ahead layers."""
    L, E, world = cfg.model.n_layers, cfg.moe.num_experts, ep.dims.size("ep")
    B, T = cfg.data.batch_size, cfg.data.seq_len
    planners = [ExpertPlanner(E, world, "prophet", costs, hysteresis=cfg.planner.hysteresis) for _ in range(L)]
    placements = [p.current for p in planners]
    top_n = min(2 * cfg.moe.top_k, E)
    out = []
    ep.set_plan_ahead(ahead)
    try:
        for i in range(spec["warmup"] + spec["steps"]):
            ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            counts = _step(model, ep, opt, ids, placements)
            used = [ahead.placed.get(j, p) for j, p in enumerate(placements)]
            acc = ahead.accuracy(dict(enumerate(counts)), {j: planners[j].forecast_RE for j in ahead.estimates},
                                 top_n)
            ahead.end_step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            t1 = time.perf_counter()
            placements = [p.step(c) for p, c in zip(planners, counts)]
            plan_s = time.perf_counter() - t1
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= spec["warmup"]:
                out.append(dict(_sample(dt.item() + plan_s, plan_s, counts, used, costs), accuracy=acc,
                                ahead_layers=sorted(ahead.placed)))
    finally:
        ep.set_plan_ahead(None)
    return out


class _Loop:
    """One routing's `ExpertBalancer` with its loop closed, kept for the whole run, and its step count."""

    def __init__(self, cfg: Config, ep: ExpertParallel, costs: MoELayerCosts) -> None:
        loop_cfg = from_dict({**to_dict(cfg), "planner": {**to_dict(cfg)["planner"], "policy": "prophet",
                                                          "feedback": {"enabled": True}}})
        self.balancer = ExpertBalancer(loop_cfg, ep.dims.size("ep"), costs, executor_overlaps=ep.overlap)
        self.ids = list(range(cfg.model.n_layers))
        for i in self.ids:
            self.balancer.add_layer(i)
        self.step = 0
        self.decisions: list[dict[str, Any]] = []


def _run_loop(model: torch.nn.Module, ep: ExpertParallel, opt: torch.optim.Optimizer, loop: _Loop, n: int,
              cfg: Config, gen: torch.Generator, costs: MoELayerCosts, warmup: int) -> list[dict[str, Any]]:
    """`n` steps of the balancer as the trainer's hook runs it (apply the arm's placements, step, time the step as
    the maximum over the ranks, observe); the samples of those after the first `warmup`."""
    B, T = cfg.data.batch_size, cfg.data.seq_len
    b, group = loop.balancer, ep.dims.group("ep")

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    out = []
    for i in range(n):
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        used = b.begin_step(loop.ids)
        arm = b.used_arm
        counts = _step(model, ep, opt, ids, used)
        step_s = b.step_time(reduce_max, torch.device("cpu"))
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        t1 = time.perf_counter()
        loop.step += 1
        b.observe(dict(zip(loop.ids, counts)), loop.step, step_s)
        plan_s = time.perf_counter() - t1
        loop.decisions += b.decisions()
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            out.append(dict(_sample(dt.item() + plan_s, plan_s, counts, used, costs), arm=arm))
    return out


# ---- Tutel on the same ranks -----------------------------------------------------------------------------

class TutelBlock(torch.nn.Module):
    """Stands in for a model's MoELayer: Tutel's dropless moe_layer over the world group (here the "ep" group:
    ep = world), holding this rank's E / world experts. The MoELayer's router and those experts' weights are
    loaded (moebal/commands/third_party.py), so both executors start from the same function. Tutel's own
    balancing loss is not added: the benchmark's aux_loss_coef is 0."""

    def __init__(self, moe: torch.nn.Module, rank: int, world: int) -> None:
        super().__init__()
        n = moe.num_experts // world
        mine = slice(rank * n, (rank + 1) * n)  # Tutel's all-to-all sends global expert g to rank g // n
        self.tutel = tp.tutel_layer(dim=moe.dim, ffn=moe.ffn_dim, experts=moe.num_experts, top_k=moe.top_k,
                                    capacity_factor=0.0, world=world)
        ex = moe.experts
        tp.load_moebal_weights(self.tutel, moe.gate.weight, ex.w1[mine], ex.w3[mine], ex.w2[mine])
        self.expert_bias: torch.Tensor | None = None  # set by _set_bias, as on a MoELayer
        self.counts: list[torch.Tensor] = []
        self.tutel.gates[0].register_forward_hook(tp.routing_hook(lambda: self.expert_bias, self.counts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tutel(x)


@dataclass
class TutelJob:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    dense: list[torch.nn.Parameter]
    experts: list[torch.nn.Parameter]
    provenance: dict[str, str]


def _tutel_job(cfg: Config, rank: int, world: int) -> tuple[TutelJob | None, str | None]:
    """moebal's model built from the same seed (the same weights) with every MoE block replaced by a
    TutelBlock; (None, why) when construction fails (it fails alike on every rank: no collective runs)."""
    try:
        torch.manual_seed(0)
        model = build_model(cfg)
        for layer in model.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe = TutelBlock(layer.block_sparse_moe, rank, world)
        expert_ids = {id(p) for b in model.moe_layers() for p in b.tutel.experts.parameters()}
        params = list(model.parameters())
        return TutelJob(model=model, opt=torch.optim.AdamW(params, lr=1e-5),
                        dense=[p for p in params if id(p) not in expert_ids],
                        experts=[p for p in params if id(p) in expert_ids], provenance=tp.tutel_provenance()), None
    except Exception as e:  # an optional third-party backend: record why it could not run, keep the others
        return None, f"construction: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _tutel_step(job: TutelJob, ids: torch.Tensor, world: int) -> None:
    out = job.model(ids[:, :-1], ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    # Dense gradients averaged over the ranks in one all-reduce; expert gradients already summed over the
    # ranks by the all-to-all's backward, divided by the same count (moebal's executor does the same).
    grads = [p.grad for p in job.dense if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g)).div_(world)
        offset += g.numel()
    for p in job.experts:
        if p.grad is not None:
            p.grad.div_(world)
    job.opt.step()
    job.opt.zero_grad(set_to_none=True)


def _run_tutel(job: TutelJob, spec: dict[str, Any], cfg: Config, gen: torch.Generator,
               world: int) -> list[dict[str, Any]]:
    """Warm-up and timed steps of the Tutel model; per-expert loads summed over the ranks outside the timing."""
    B, T = cfg.data.batch_size, cfg.data.seq_len
    out = []
    for i in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        _tutel_step(job, ids, world)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        counts_LE = torch.stack([b.counts[0].to(torch.float64) for b in job.model.moe_layers()])
        dist.all_reduce(counts_LE)
        if i >= spec["warmup"]:
            imbalance = (counts_LE.max(dim=1).values / counts_LE.mean(dim=1)).mean().item()
            out.append({"step_s": dt.item(), "expert_imbalance": imbalance})
    return out


def _tutel_record(routing: str, world: int, s: list[dict], provenance: dict[str, str]) -> dict[str, Any]:
    steps = [x["step_s"] for x in s]
    rounds = sorted({x["round"] for x in s})
    return {"policy": TUTEL, "round_medians_s": [statistics.median(x["step_s"] for x in s if x["round"] == r)
                                                 for r in rounds],
            "executor": TUTEL, "label": LABELS[TUTEL], "routing": routing, "world_size": world,
            "step_time_median_s": statistics.median(steps), "step_time_min_s": min(steps),
            "step_time_max_s": max(steps), "steps": len(steps), "capacity_factor": 0.0,
            "expert_load_max_over_mean": float(np.mean([x["expert_imbalance"] for x in s])),
            "tutel": provenance, "note": NOTES[TUTEL]}


def _sample(step_s: float, plan_s: float, counts: list[np.ndarray], used: list[ExpertPlacement], costs) -> dict:
    per_layer = [placement_metrics(c, p, costs) for c, p in zip(counts, used)]
    expert_loads = [c.sum(axis=0) for c in counts]
    return {"step_s": step_s, "plan_s": plan_s, "layers": per_layer,
            "expert_imbalance": float(np.mean([x.max() / x.mean() for x in expert_loads])),
            "replicas": sum(p.num_replicas for p in used)}


def _record(routing: str, policy: str, world: int, s: list[dict], costs, cfg: Config) -> dict[str, Any]:
    steps = [x["step_s"] for x in s]

    def mean_of(key: str) -> float:
        return float(np.mean([np.mean([layer[key] for layer in x["layers"]]) for x in s]))

    def total_of(key: str) -> float:
        return float(np.mean([sum(layer[key] for layer in x["layers"]) for x in s]))

    rounds = sorted({x["round"] for x in s})
    extra = {"plan_arm_share": float(np.mean([x["arm"] == "plan" for x in s]))} if "arm" in s[0] else {}
    if "accuracy" in s[0]:
        keys = sorted({k for x in s for k in x["accuracy"]})
        extra["prediction"] = {k: float(np.mean([x["accuracy"][k] for x in s if k in x["accuracy"]])) for k in keys}
        extra["prediction_steps"] = sum(bool(x["accuracy"]) for x in s)
        extra["ahead_layers"] = sorted({j for x in s for j in x["ahead_layers"]})
    return {
        "policy": policy, "executor": "moebal", "label": LABELS[policy], "note": NOTES[policy],
        "routing": routing, "world_size": world,
        "step_time_median_s": statistics.median(steps), "step_time_min_s": min(steps),
        "step_time_max_s": max(steps), "steps": len(steps),
        "round_medians_s": [statistics.median(x["step_s"] for x in s if x["round"] == r) for r in rounds], **extra,
        "expert_load_max_over_mean": float(np.mean([x["expert_imbalance"] for x in s])),
        "rank_load_max_over_mean_before": mean_of("imbalance_before"),
        "rank_load_max_over_mean_after": mean_of("imbalance_after"),
        "balance_degree_before": mean_of("balance_degree_before"),
        "balance_degree_after": mean_of("balance_degree_after"),
        "a2a_bytes_per_step": total_of("a2a_bytes"), "trans_bytes_per_step": total_of("trans_bytes"),
        "agg_bytes_per_step": total_of("agg_bytes"), "replicas_per_step": float(np.mean([x["replicas"] for x in s])),
        "planner_time_median_s": statistics.median(x["plan_s"] for x in s),
        "measured_costs": describe(costs),
    }


def recorded_shares(run_dir: Path) -> list[float] | None:
    """Per-expert shares (all MoE layers pooled) of the last logged steps of a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    counts = [r["expert_counts"] for r in rows if "expert_counts" in r][-20:]
    if not counts:
        return None
    pooled = np.sum([np.sum(np.asarray(c, dtype=np.float64), axis=0) for c in counts], axis=0)
    return (pooled / pooled.sum()).tolist()


def summarise(records: list[dict[str, Any]]) -> list[str]:
    """Per (ranks, routing): each method's median step time and its ratio to static placement, then each round's
    ratios to static (the same round's static steps); Pro-Prophet's ratios to the others on skewed routings."""
    timed = [r for r in records if "failed" not in r]
    by = {(r["world_size"], r["routing"], r["policy"]): r for r in timed}
    lines = [LEGEND]
    for world in sorted({r["world_size"] for r in timed}):
        limit = by.get((world, "balanced", "static"))
        for routing in ("balanced", "skewed", "recorded"):
            row = {m: by[(world, routing, m)] for m in METHODS if (world, routing, m) in by}
            if not row:
                continue
            cells = "  ".join(f"{LABELS[m]} {r['step_time_median_s']:.4f}s" for m, r in row.items())
            lines.append(f"{world} ranks {routing:9s} {cells}")
            static = row.get("static")
            if static:
                lines.append(f"{'':18s}median ratio to static: " + "  ".join(
                    f"{LABELS[m]} {r['step_time_median_s'] / static['step_time_median_s']:.3f}"
                    for m, r in row.items() if m != "static"))
                for k, s0 in enumerate(static.get("round_medians_s", [])):
                    lines.append(f"{'':18s}round {k + 1} ratio to static: " + "  ".join(
                        f"{LABELS[m]} {r['round_medians_s'][k] / s0:.3f}" for m, r in row.items()
                        if m != "static" and len(r.get("round_medians_s", [])) > k))
                lines.append(f"{'':18s}median of the round ratios: " + "  ".join(
                    f"{LABELS[m]} {r['median_round_ratio_to_static']:.3f}" for m, r in row.items()
                    if "median_round_ratio_to_static" in r))
            if routing != "balanced" and limit and "prophet" in row:
                p = row["prophet"]["step_time_median_s"]
                lines.append(f"{'':18s}prophet/limit {p / limit['step_time_median_s']:.3f}" + "".join(
                    f"  prophet/{LABELS[m]} {p / r['step_time_median_s']:.3f}" for m, r in row.items()
                    if m != "prophet"))
            if AHEAD in row:
                a = row[AHEAD]
                pr = a.get("prediction", {})
                ratios = "  ".join(f"{k.replace('median_round_ratio_', '')} {a[k]:.3f}" for k in
                                   ("median_round_ratio_to_static", "median_round_ratio_to_prophet") if k in a)
                lines.append(f"{'':18s}{AHEAD} (layers {a.get('ahead_layers')}): median of the round ratios {ratios}; "
                             f"top-2k overlap path {pr.get('path_overlap', math.nan):.3f} vs previous "
                             f"{pr.get('prev_overlap', math.nan):.3f}, MAE/mean path "
                             f"{pr.get('path_rel_mae', math.nan):.3f} vs previous "
                             f"{pr.get('prev_rel_mae', math.nan):.3f} ({a.get('prediction_steps', 0)} steps)")
            if FEEDBACK in row:
                share = row[FEEDBACK].get("plan_arm_share", 0.0)
                verdicts = [d["verdict"] for d in row[FEEDBACK].get("feedback_decisions", [])]
                lines.append(f"{'':18s}{FEEDBACK}: plan arm on {share:.0%} of the timed steps; verdicts {verdicts}")
    lines += [f"{r['world_size']} ranks {LABELS[r['policy']]} FAILED in {r['failed']}"
              for r in records if "failed" in r]
    return lines


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if "failed" not in r]
    groups = sorted({(r["world_size"], r["routing"]) for r in timed})
    methods = [m for m in METHODS if any(r["policy"] == m for r in timed)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        vals = [next((r["step_time_median_s"] for r in timed if (r["world_size"], r["routing"]) == g
                      and r["policy"] == method), math.nan) for g in groups]
        ax.bar(np.arange(len(groups)) + i * width, vals, width, label=LABELS[method])
    ax.set_xticks(np.arange(len(groups)) + width * (len(methods) - 1) / 2, [f"{w} ranks\n{r}" for w, r in groups])
    ax.set_ylabel("median step time (s)")
    ax.set_title("Expert-parallel step time by method (lower is better)\n"
                 "fastermoe-policy: FasterMoE's placement policy on moebal's executor, not FasterMoE", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _busy(n: int) -> list[subprocess.Popen]:
    """`n` processes that spin on a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 ranks only, fewer rounds")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("--png", type=Path, help="write a bar chart here (default: next to --json)")
    ap.add_argument("--recorded", type=Path, help="a run directory whose routing to replay")
    ap.add_argument("--skew", type=float, default=3.0, help="strength s of the skew bias -s*log(id+1)")
    ap.add_argument("--rounds", type=int, help="rounds (default 2 with --quick, else 3); more rounds of fewer steps "
                    "compare the methods closer in time, which a machine whose load changes needs")
    ap.add_argument("--steps", type=int, help="timed steps per method and round (default 4 with --quick, else 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per method and round (>= 1: a fresh "
                    "planner's first step has no history and runs static placement)")
    ap.add_argument("--methods", nargs="+", choices=(*POLICIES, FEEDBACK, AHEAD),
                    help="moebal methods to run (default: all; static is needed for the ratios)")
    ap.add_argument("--path-len", type=at_least(1), default=1, help="plan-ahead's path length l (layers >= l are "
                    "planned ahead; the benchmark model has 2 MoE layers, so 1 is the only length that plans one)")
    ap.add_argument("--path-settle", type=int, default=10, help="untimed plan-ahead steps per routing before the "
                    "rounds, so the online profile exists (rebuilt every 5 steps from the last 20)")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="keep N busy processes running for the whole run (a machine shared with other jobs)")
    add_device_argument(ap, cpu_only=CPU_ONLY)
    args = ap.parse_args(argv)
    script_device(args.device, cpu_only=CPU_ONLY)
    if args.load < 0:
        ap.error(f"--load must be >= 0 (busy background processes); got {args.load}")
    for name in ("rounds", "steps", "warmup"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    cfg = bench_config(args.quick)
    window = cfg.planner.feedback.window
    spec = {"config": to_dict(cfg), "skew": args.skew, "rounds": args.rounds or (2 if args.quick else 3),
            "steps": args.steps or (4 if args.quick else 6), "warmup": args.warmup, "settle": 1 + 2 * window,
            "recorded_shares": recorded_shares(args.recorded) if args.recorded else None,
            "tutel": tp.tutel_importable(), "path_len": args.path_len, "path_settle": args.path_settle,
            "path_refresh": 5, "path_window": 20}
    if args.methods:
        spec["policies"] = list(args.methods)
    if not spec["tutel"]:
        print(f"tutel skipped: {tp.NOT_IMPORTABLE}", file=sys.stderr)
    if args.recorded and spec["recorded_shares"] is None:
        print(f"no per-expert counts in {args.recorded}/metrics.jsonl: skipping the recorded routing",
              file=sys.stderr)
    records: list[dict[str, Any]] = []
    loadavg_start = os.getloadavg()  # other jobs on the machine, before the busy processes start
    load = _busy(args.load)
    try:
        for world in ([2] if args.quick else [2, 4]):
            records += run_ranks(_worker, world, spec, timeout_s=1800)[0]
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor(), "cpus": os.cpu_count(), "threads_per_rank": 1,
            "config": spec["config"], "skew": args.skew, "load": args.load,
            "loadavg_start": [round(x, 2) for x in loadavg_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "load_note": f"{args.load} busy Python processes ran for the whole run, calibration included",
            "rounds": spec["rounds"], "steps_per_round": spec["steps"], "warmup": spec["warmup"],
            "feedback_settle_steps": spec["settle"],
            "plan_ahead": {k: spec[k] for k in ("path_len", "path_settle", "path_refresh", "path_window")},
            "tutel": tp.tutel_provenance() if spec["tutel"] else f"skipped: {tp.NOT_IMPORTABLE}"}
    for r in records:
        r["meta"] = meta
    for line in summarise(records):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1))
        plot(records, args.png or args.json.with_suffix(".png"))
    elif args.png:
        plot(records, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
