"""Dynamism schemes without a pipeline: `parallel.pp 1` with a scheme trains on the pipeline engine as one stage
(`Config.pipelined`; docs/dynamism.md, "Without a pipeline").

One stage is one more partition of the layers, and no scheme decision, loss sum or gradient norm depends on the
partition (migrations keep the losses bit for bit: tests/distributed/test_pipeline.py), so a one-stage run's
losses are a two-stage run's bit for bit. Without a scheme a one-stage step is the single-process loop over the
same micro-batches (`reference_losses`); with two data-parallel copies of the one stage the losses stay within
rounding of one process.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from moebal.config import load
from moebal.distributed.testing import run_ranks
from moebal.errors import ConfigError
from moebal.planner.memory import layout_from_config
from tests.cli_util import run_cli
from tests.distributed.test_pipeline import SCHEMES, _train, reference_losses, tiny

SPARSE = {"budget": "random_walk", "block": 4, "min_density": 0.05, "walk_step": 0.5, "start": 1, "costs": "given"}
ALL = {**SCHEMES, "sparse_attention": SPARSE}


def _scheme_runs(pp: int, nproc: int, names: tuple[str, ...] = tuple(ALL)) -> dict[str, dict]:
    return {name: _train(tiny(n_layers=6, pp=pp, moe=4 if name == "moe" else 0, nproc=nproc), 6, name, ALL[name],
                         micro_batches=2) for name in names}


def _sharded_runs(shard: str) -> dict[str, dict]:
    """One process under `parallel.shard` (nothing to shard over: it must train as unsharded)."""
    out = {}
    for name in ("freezing", "moe"):
        cfg = tiny(n_layers=6, pp=1, moe=4 if name == "moe" else 0, nproc=1)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard=shard))
        out[name] = _train(cfg, 6, name, ALL[name], micro_batches=2)
    return out


def _predictor_runs() -> dict[str, dict]:
    """MoD with and without its causal predictors, gradient clipping off and on (module test below)."""
    out = {}
    for clip in (0.0, 1.0):
        cfg = tiny(n_layers=6, pp=1, nproc=1)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_clip=clip))
        for width in (0, 8):
            out[f"clip {clip}, predictor {width}"] = _train(cfg, 4, "mod", {**ALL["mod"], "predictor": width},
                                                             micro_batches=2)
    return out


def _predictor_grads(nproc: int, micro_batches: int) -> dict[str, np.ndarray]:
    """The MoD predictors' gradients of one step (summed over the stage's ranks, clipping off), as the optimizer
    gets them."""
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    cfg = tiny(n_layers=4, pp=1, nproc=nproc, grad_clip=0.0)
    runner = PipelineRunner(dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline,
                                                                                   micro_batches=micro_batches)),
                            scheme=build_dynamism("mod", {**ALL["mod"], "start": 0, "predictor": 8}, cfg=cfg))
    grads: dict[str, np.ndarray] = {}
    clip = runner._clip

    def capture(*args):
        grads.update({n: p.grad.numpy().copy() for n, p in runner.stage.named_parameters()
                      if p.grad is not None and "mod_predictor" in n})
        return clip(*args)

    runner._clip = capture
    runner.train(1)
    return grads


def _one_rank(rank: int, world: int) -> dict:
    return {"schemes": _scheme_runs(1, 1), "plain": _train(tiny(pp=1), 4, micro_batches=2),
            "sharded": {shard: _sharded_runs(shard) for shard in ("optimizer", "full")},
            "predictor": _predictor_runs(), "predictor_grads": {m: _predictor_grads(1, m) for m in (1, 4)}}


def _two_ranks(rank: int, world: int) -> dict:
    return {"two_stages": _scheme_runs(2, 2),
            "data_parallel": _scheme_runs(1, 2, ("sparse_attention", "freezing", "early_exit")),
            "expert_parallel": _scheme_runs(1, 2, ("moe",)),  # a MoE model: the stage's 2 ranks are expert shards
            "predictor_grads": _predictor_grads(2, 1)}


@pytest.fixture(scope="module")
def one() -> dict:
    return run_ranks(_one_rank, 1)[0]


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(_two_ranks, 2)


def test_one_stage_without_a_scheme_is_the_single_process_step(one):
    ref, _ = reference_losses(tiny(pp=1), 4, micro=2)
    got = one["plain"]["losses"]
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got, ref, strict=True)), (got, ref)
    assert one["plain"]["sizes"] == [4]


@pytest.mark.parametrize("name", list(ALL))
def test_every_scheme_on_one_stage_gives_the_two_stage_losses_bit_for_bit(one, two, name):
    got = one["schemes"][name]
    assert got["sizes"] == [6] and len(got["losses"]) == 6
    assert got["losses"] == two[0]["two_stages"][name]["losses"], name


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_one_process_under_a_shard_setting_trains_as_unsharded(one, shard):
    # `parallel.shard: full` on one process built FSDP2 over no process group and failed at start-up
    for name, run in one["sharded"][shard].items():
        ref = one["schemes"][name]["losses"]
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(run["losses"], ref, strict=True)), (name, shard)


def test_mod_s_predictors_train_beside_the_run_and_change_it_only_through_the_clipped_norm(one):
    """The predictors' gradients reach only their own parameters, so without gradient clipping a run with them
    has the losses of one without, bit for bit; with clipping their gradient joins the global norm
    (`train.grad_clip`), which scales every step's update, so the runs part after the first step (docs)."""
    runs = one["predictor"]
    assert runs["clip 0.0, predictor 8"]["losses"] == runs["clip 0.0, predictor 0"]["losses"]
    clipped = runs["clip 1.0, predictor 8"]["losses"], runs["clip 1.0, predictor 0"]["losses"]
    assert clipped[0][0] == clipped[1][0] and clipped[0] != clipped[1]
    assert "predictor_accuracy" in runs["clip 0.0, predictor 8"]["records"][-1]
    assert "predictor_accuracy" not in runs["clip 0.0, predictor 0"]["records"][-1]


def test_mod_s_predictor_gradient_is_one_mean_over_the_batch_however_the_step_is_split(one, two):
    """The predictors' loss enters each forward weighted as the MoE auxiliary losses (`Dynamism.aux_weight`), so
    their summed gradient is the same on 1 or 4 micro-batches and on 1 or 2 data-parallel ranks (it was the
    sum of the forwards' means: 4x and 2x)."""
    ref = one["predictor_grads"][1]
    assert ref and all(np.abs(g).max() > 0 for g in ref.values())
    scale = max(float(np.abs(g).max()) for g in ref.values())  # a bias's summed gradient may nearly cancel
    for got in (one["predictor_grads"][4], two[0]["predictor_grads"]):
        assert got.keys() == ref.keys()
        for name, g in ref.items():
            np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


def test_the_scheme_acts_on_one_stage(one):
    runs = one["schemes"]
    dens = [r["attention_density"] for r in runs["sparse_attention"]["records"]]
    assert dens[0] == [1.0] * 6 and all(min(d) < 1.0 for d in dens[1:])  # dense until `start`, then the walk
    assert max(r["frozen_layers"] for r in runs["freezing"]["records"]) > 0
    assert runs["pruning"]["records"][-1]["sparsity_target"] > 0
    assert min(min(r["survival"]) for r in runs["early_exit"]["records"]) < 1.0


@pytest.mark.parametrize("layout,name", [("data_parallel", "sparse_attention"), ("data_parallel", "freezing"),
                                         ("data_parallel", "early_exit"), ("expert_parallel", "moe")])
def test_one_stage_on_two_ranks_matches_one_process(one, two, layout, name):
    """Within rounding of one process, up to a discrete decision rounding can flip: a token whose early-exit
    confidence lies within rounding of the threshold exits in one run and not the other (on an AVX-512 Xeon one
    token of 128 at step 4, 1.7e-5 apart in the loss after it). The steps before the first flip agree to 1e-5,
    the flip moves at most a token or two, and the losses after it stay within 1e-3."""
    got = [r[layout][name]["losses"] for r in two]
    assert got[0] == got[1]  # both ranks report the same loss
    ref = one["schemes"][name]["losses"]
    flip = len(ref)
    if name == "early_exit":
        mine, theirs = ([r["survival"] for r in run["records"]] for run in (two[0][layout][name], one["schemes"][name]))
        flip = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), len(ref))
        if flip < len(ref):
            assert flip >= 2 and max(abs(a - b) for a, b in zip(mine[flip], theirs[flip])) <= 2 / 128, (mine, theirs)
            assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(got[0][flip:], ref[flip:])), (got[0], ref)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got[0][:flip], ref[:flip], strict=True)), (got[0], ref)


def test_a_one_stage_run_refuses_what_only_the_trainer_without_a_pipeline_runs():
    scheme = ["dynamism.scheme=sparse_attention"]
    assert load(overrides=scheme).pipelined and not load().pipelined
    with pytest.raises(ConfigError, match=r"one-stage pipeline\) accumulates over its micro-batches"):
        load(overrides=[*scheme, "train.grad_accum=2"])
    assert load(overrides=[*scheme, "train.record_routing_every=5"]).pipelined  # the stage's layers record too
    with pytest.raises(ConfigError, match="routes a subset of the tokens"):
        load(overrides=["dynamism.scheme=mod", "train.record_routing_every=5"])
    # planned micro-batches record the real tokens of the micro-batch every stage forwards last
    assert load(overrides=["parallel.pp=2", "pipeline.microbatching=dynamic", "train.record_routing_every=5"])


def test_the_memory_plan_counts_a_one_stage_pipeline_s_micro_batches():
    cfg = load(overrides=["dynamism.scheme=freezing", "parallel.pp=1", "pipeline.micro_batches=4",
                          "data.batch_size=6"])
    lay = layout_from_config(cfg, 1, shard="none")
    assert lay.pp == 1 and lay.micro_batches == 4  # 6 rows in 4 micro-batches of 1-2 rows, as the engine cuts them
    assert layout_from_config(load(), 1, shard="none").micro_batches == 1  # train.grad_accum without a scheme


@pytest.mark.slow
def test_train_with_a_scheme_and_no_pipeline_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--dynamism", "sparse_attention", "--out", str(out),
            "parallel.nproc=1", "model.dim=32", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=64", "moe.num_experts=0", "data.seq_len=16", "data.batch_size=4", "data.max_bytes=200000",
            "train.ckpt_every=2", "pipeline.micro_batches=2", *(f"dynamism.sparse_attention.{k}={v}"
                                                                for k, v in SPARSE.items())]
    proc = run_cli(*base, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1-stage pipeline x 1 data-parallel x 1 expert-parallel" in proc.stderr
    proc = run_cli(*base, "--steps", "4", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)
