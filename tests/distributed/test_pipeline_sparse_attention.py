"""Dynamic sparse attention on a 2-stage gloo pipeline: migrations, per-step rebalancing and resume keep the losses.

One spawned job runs, on a tiny 6-layer model with 32-token rows (blocks of 4 or 8), each budget rule
static, with forced migrations, and with the partition balancer re-planning after every step (replan_every_step);
then a checkpointed run is interrupted after step 3 and resumed. The losses must be bitwise equal: which blocks a
layer keeps depends on its own activations and the agreed densities only, never on the partition.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

OPTIONS = {
    "random_walk": {"budget": "random_walk", "block": 4, "min_density": 0.05, "walk_step": 0.5, "start": 1},
    "coverage": {"budget": "coverage", "block": 8, "coverage": 0.6, "min_density": 0.2, "start": 1},
}


def cfg_for(budget: str, steps: int = 6, attn_weight: float = 1.0, costs: str = "given", **train) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 0},
        "data": {"seq_len": 32, "batch_size": 4, "max_bytes": 200_000},
        "train": {"steps": steps, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32", "threads": 1,
                  **train},
        "parallel": {"pp": 2, "nproc": 2},
        "dynamism": {"scheme": "sparse_attention", "sparse_attention": {**OPTIONS[budget], "attn_weight": attn_weight,
                                                                  "costs": costs}},
        "pipeline": {"micro_batches": 2}})


def _train(cfg: Config, steps: int, **opts) -> dict:
    import dataclasses

    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    knobs = {k: opts.pop(k) for k in ("force", "bandwidth", "latency") if k in opts}
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **opts))
    dyn = build_dynamism("sparse_attention", dataclasses.asdict(cfg.dynamism.sparse_attention), cfg=cfg)
    runner = PipelineRunner(cfg, scheme=dyn, **knobs)
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "records": out.records,
            "plan_steps": [p["step"] for p in out.plans], "unit_factors": runner.balancer.factors().tolist()}


def _timed_as(factors: list[float]):
    """Stand in for the start-up timing of `costs: measure`: every call 'measures' `factors`."""
    import moebal.dynamism.sparse_attention as sa

    sa.measure_attention_factors = lambda *args, **kwargs: list(factors)


def _checkpointed(rank: int, cfg: Config, out: Path, resume: bool = False) -> list[dict] | None:
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.train.pipelined import pipeline_trainer

    dims = ParallelDims(world_size=dist.get_world_size(), rank=rank, pp=2, ep=1).init()
    trainer = pipeline_trainer(cfg, out, resume=resume, dims=dims, force=((2, (2, 4)),))
    try:
        trainer.train()
    finally:
        trainer.close()
    dist.barrier()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if rank == 0 else None


def _job(rank: int, world: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(99 + rank)  # a different global RNG state per rank must not matter
    out: dict = {}
    for budget in OPTIONS:
        cfg = cfg_for(budget)
        out[f"{budget}_static"] = _train(cfg, 6)
        out[f"{budget}_forced"] = _train(cfg, 6, force=((2, (2, 4)), (4, (5, 1))))
        # free migrations, no minimum gain, an attention core weighted 200x in the predictions (the prediction
        # only steers where layers go; the losses must not notice); a forced lopsided partition after step 1
        # (layer 0 alone on the first stage) that the planner must undo
        out[f"{budget}_planned"] = _train(cfg_for(budget, attn_weight=200.0), 6, rebalance="partition", every=2,
                                          min_gain=0.0, bandwidth=1e15, latency=0.0, force=((1, (1, 5)),))
        # layer halves: 12 units, [6, 6] at the start; (5, 7) puts layer 2's attention half on the first stage and
        # its FFN half on the second, (9, 3) layer 4's
        out[f"{budget}_split"] = _train(cfg, 6, split_layers=True)
        out[f"{budget}_split_forced"] = _train(cfg, 6, split_layers=True, force=((2, (5, 7)), (4, (9, 3))))
        out[f"{budget}_split_planned"] = _train(cfg_for(budget, attn_weight=200.0), 6, split_layers=True,
                                                rebalance="partition", every=2, min_gain=0.0, bandwidth=1e15,
                                                latency=0.0, force=((1, (2, 10)),))
        # recomputation: the scheme replays its own attention (whole layers, and halves cut inside layers)
        for mode in ("attention", "full"):
            out[f"{budget}_{mode}"] = _train(cfg_for(budget, recompute=mode), 6, force=((2, (2, 4)),))
            out[f"{budget}_split_{mode}"] = _train(cfg_for(budget, recompute=mode), 6, split_layers=True,
                                                   force=((2, (5, 7)),))
    # costs: measure, timed for real (a tiny shape: fitted or not, every rank must end with the same constants)
    out["measured_real"] = _train(cfg_for("coverage", costs="measure"), 2)
    # ... and with each rank 'timing' its own factors: the job fits their mean, once
    import moebal.dynamism.sparse_attention as sa

    timing = sa.measure_attention_factors
    _timed_as(MEASURED[rank])
    out["measured"] = _train(cfg_for("random_walk", costs="measure"), 6)
    base = Path(tmp)
    ck = cfg_for("random_walk", costs="measure", ckpt_every=3, keep_checkpoints=10)
    out["whole"] = _checkpointed(rank, ck, base / "whole")
    if rank == 0:
        shutil.copytree(base / "whole", base / "resumed")
        shutil.rmtree(base / "resumed" / "ckpt-0000006")
    dist.barrier()
    _timed_as(MEASURED_ON_RESUME)  # the resumed job measures other constants; it must plan with the checkpoint's
    out["resumed"] = _checkpointed(rank, ck, base / "resumed", resume=True)
    sa.measure_attention_factors = timing
    return out


# attention fwd+bwd over dense at densities 0.75 / 0.5 / 0.25 / 0.1, as each rank 'measures' it (`_timed_as`)
MEASURED = ([0.9, 0.8, 0.65, 0.6], [0.95, 0.78, 0.7, 0.62])
MEASURED_ON_RESUME = [1.2, 1.1, 1.0, 0.95]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_job, 2, str(tmp_path_factory.mktemp("sparse_attention")), timeout_s=600)


@pytest.mark.parametrize("budget", list(OPTIONS))
def test_migrated_and_rebalanced_runs_give_the_static_losses(runs, budget):
    r = runs[0]
    static = r[f"{budget}_static"]
    assert r[f"{budget}_forced"]["losses"] == static["losses"]
    assert r[f"{budget}_forced"]["sizes"] == [5, 1]
    planned = r[f"{budget}_planned"]
    assert planned["losses"] == static["losses"]
    assert any(x.get("migration") == "partition" for x in planned["records"])  # the planner undid the forced cut
    dens = [rec["attention_density"] for rec in static["records"]]
    assert all(d == 1.0 for d in dens[0])  # dense until `start`
    assert any(d < 1.0 for d in dens[-1])
    if budget == "random_walk":  # the coverage rule's densities stay put on a barely trained model's flat scores
        assert len({tuple(d) for d in dens[1:]}) == len(dens) - 1  # the walk moves every step
    # every rank predicts every layer alike (each holds other layers)
    assert runs[1][f"{budget}_static"]["records"][-1]["predicted_cost"] == static["records"][-1]["predicted_cost"]


@pytest.mark.parametrize("budget", list(OPTIONS))
def test_layer_halves_run_the_sparse_attention_and_keep_the_losses(runs, budget):
    """`pipeline.split_layers`: every layer splits (the scheme runs the attention half), a boundary inside a layer
    changes no loss, and the split run matches whole layers up to the order of the gradient norm's per-slot sums."""
    r = runs[0]
    split, static = r[f"{budget}_split"], r[f"{budget}_static"]
    assert split["sizes"] == [6, 6]  # 12 units: every layer in two halves
    for a, b in zip(split["losses"], static["losses"]):
        assert math.isclose(a, b, rel_tol=1e-6), (a, b)
    assert [x["attention_density"] for x in split["records"]] == [x["attention_density"] for x in static["records"]]
    forced = r[f"{budget}_split_forced"]
    assert forced["losses"] == split["losses"] and forced["sizes"] == [9, 3]
    assert [x["sizes_after"] for x in forced["records"] if x.get("migration")] == [[5, 7], [9, 3]]
    planned = r[f"{budget}_split_planned"]
    assert planned["losses"] == split["losses"]
    assert any(x.get("migration") == "partition" for x in planned["records"])  # the planner moved halves
    # the units' predictions: an FFN half costs what it costs dense, an attention half moves with its density
    pred = split["unit_factors"]
    assert pred[1::2] == [1.0] * 6 and any(c != 1.0 for c in pred[0::2])


@pytest.mark.parametrize("budget", list(OPTIONS))
def test_recomputed_sparse_attention_keeps_the_losses_bit_for_bit(runs, budget):
    """`train.recompute` attention and full replay the scheme's own attention, on whole layers and on halves cut
    inside a layer: the losses, densities and predictions of the run without it, bit for bit (that a replay adds
    nothing to the coverage statistics is checked on the raw sums in tests/unit/test_sparse_attention_scheme.py)."""
    r = runs[0]
    for mode in ("attention", "full"):
        for ref, key in ((f"{budget}_static", f"{budget}_{mode}"), (f"{budget}_split", f"{budget}_split_{mode}")):
            got, want = r[key], r[ref]
            assert got["losses"] == want["losses"], key
            for field in ("attention_density", "predicted_cost"):
                assert [x[field] for x in got["records"]] == [x[field] for x in want["records"]], (key, field)
            assert any(x.get("migration") for x in got["records"]), key


def test_the_balancer_replans_every_step(runs):
    run = runs[0]["random_walk_planned"]
    # profiled at step 2 (every 2), then a plan after every step, profiled or not
    assert run["plan_steps"][:4] == [2, 3, 4, 5]
    # (the run starts from a forced lopsided partition after step 1: the planner's migrations undo it, and
    # test_migrated_and_rebalanced_runs_give_the_static_losses checks that they keep the losses)


def test_resume_continues_the_walk_exactly(runs):
    whole, got = runs[0]["whole"], runs[0]["resumed"]
    steps = [r for r in whole if "loss" in r]
    resumed = [r for r in got if "loss" in r]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in steps]
    assert [r["attention_density"] for r in resumed] == [r["attention_density"] for r in steps]
    # the cost constants measured by the first job, not the resumed job's own measurement: the same predictions
    assert [r["attention_cost_constants"] for r in resumed] == [r["attention_cost_constants"] for r in steps]
    assert [r["predicted_cost"] for r in resumed] == [r["predicted_cost"] for r in steps]


def test_measured_cost_constants_are_one_fit_of_every_ranks_times(runs):
    """`costs: measure`: the ranks time different factors; each fits the job's mean, so both plan alike, and the
    losses are the run's with the given constants (the constants only steer the plans)."""
    from moebal.dynamism.scheme import layer_token_flops
    from moebal.dynamism.sparse_attention import COST_DENSITIES
    from moebal.planner.sparse_blocks import fit_cost_constants, kept_fraction

    c = cfg_for("random_walk")
    f = layer_token_flops(c, 0, 32)
    mean = [(a + b) / 2 for a, b in zip(*MEASURED)]
    w, o = fit_cost_constants([(kept_fraction(32, 4, d), m) for d, m in zip(COST_DENSITIES, mean)],
                              f["q_o"] + f["kv"], f["attn"])
    got = [r["measured"]["records"] for r in runs]
    assert got[0][-1]["attention_cost_constants"] == [round(w, 4), round(o, 4)]
    assert [x["predicted_cost"] for x in got[0]] == [x["predicted_cost"] for x in got[1]]
    assert runs[0]["measured"]["losses"] == runs[0]["random_walk_static"]["losses"]
    assert got[0][-1]["predicted_cost"] != runs[0]["random_walk_static"]["records"][-1]["predicted_cost"]
    real = [r["measured_real"]["records"][-1]["attention_cost_constants"] for r in runs]
    assert real[0] == real[1]
    assert runs[0]["measured_real"]["losses"] == runs[0]["coverage_static"]["losses"][:2]
