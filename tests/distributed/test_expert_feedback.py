"""The expert balancer's closed loop on 2 gloo ranks with the trainer: whatever the arm, the losses are static's."""

from __future__ import annotations

import json
import math
from pathlib import Path

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

STEPS = 8


def _cfg(policy: str, feedback: dict[str, object]) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.01},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": STEPS, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32",
                  "ckpt_every": 0, "progress": "plain", "threads": 1},
        # a fixed hardware profile and no hysteresis: the plans are the same in every run, and replicate
        "planner": {"policy": policy, "costs": "h100", "hysteresis": 0.0, "feedback": feedback}})


def _train(cfg: Config, out: Path, slow_plan: bool) -> list[dict]:
    from moebal.balance.experts import ExpertParallelHook
    from moebal.train.distributed import setup_parallel
    from moebal.train.trainer import Trainer

    ctx, model, hooks = setup_parallel(cfg, run_dir=out)
    if slow_plan:  # a machine on which the plan measures slower than static placement: the loop must back off
        [hook] = [h for h in hooks if isinstance(h, ExpertParallelHook)]
        b = hook.balancer
        b.step_time = lambda reduce_max, device: 2.0 if b.used_arm == "plan" else 1.0
    trainer = Trainer(cfg, out, model=model, hooks=hooks, ctx=ctx)
    trainer.train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if ctx.is_main else []


def _worker(rank: int, world: int, root: str) -> dict[str, list[dict]]:
    loop = {"enabled": True, "window": 1, "hold": 2, "max_hold": 4}
    runs = {"static": (_cfg("static", {}), False), "open": (_cfg("prophet", {}), False),
            "backed_off": (_cfg("prophet", loop), True), "timed": (_cfg("prophet", loop), False)}
    return {name: _train(cfg, Path(root) / name, slow) for name, (cfg, slow) in runs.items()}


def test_a_forced_backing_off_keeps_the_losses_of_static_placement(tmp_path):
    out = run_ranks(_worker, 2, str(tmp_path))[0]
    static, open_loop, backed, timed = (out[k] for k in ("static", "open", "backed_off", "timed"))
    assert [r["step"] for r in backed] == list(range(1, STEPS + 1))
    # replica parity: Agg changes only a gradient sum's order (a 1 % error in it moves the losses by ~1e-6)
    for name, run in (("open", open_loop), ("backed_off", backed), ("timed", timed)):
        for a, b in zip(static, run):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (name, a["step"], a["loss"], b["loss"])
    # warm-up, a trial of one pair (base, plan), 2 steps held, a new trial, held again
    arms = [r["placement_arm"] for r in backed]
    assert arms == ["base", "base", "plan", "base", "base", "base", "plan", "base"], arms
    assert all((sum(r["replicas"]) > 0) == (a == "plan") for r, a in zip(backed, arms))  # plans replicate
    verdicts = [v for r in backed for v in r.get("placement_feedback", [])]
    assert [v["verdict"] for v in verdicts] == ["backed_off", "backed_off"]
    assert verdicts[0]["measured_gain"] == -1.0 and "predicted_gain" in verdicts[0]
    assert "placement_arm" not in open_loop[-1] and sum(open_loop[-1]["replicas"]) > 0
    # measured for real (the step time's maximum over the ranks, through the scheduler) on the steps of a trial
    # only, a verdict at step 3; the warm-up step and the steps between trials spend no collective on it
    measured = {r["step"]: r["placement_step_s"] for r in timed}
    assert measured[1] is None and measured[2] > 0 and measured[3] > 0
    assert all(s is None or s > 0 for s in measured.values()) and None in list(measured.values())[3:]
    assert [v["step"] for r in timed for v in r.get("placement_feedback", [])][:1] == [3]
    plans = [json.loads(line) for line in (tmp_path / "backed_off" / "plans.jsonl").read_text().splitlines()]
    assert [p["arm"] for p in plans] == arms and plans[2]["feedback"][0]["verdict"] == "backed_off"
