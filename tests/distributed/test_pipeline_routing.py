"""The pipeline's per-step routing point (`StageExperts._take_routing`): the auxiliary-loss-free selection bias
(`moe.bias_update_rate`, DeepSeek-V3) steps once per optimizer step on the stage's summed gate assignments, and
every step's record carries the routing summary of the trainer without a pipeline (loads, drops, expert counts).

Reference: the single-process loop over the same micro-batches with the same bias rule
(`tests/distributed/test_pipeline.py` `reference_losses`). Expert counts are integers, so they, and the biases
that follow from them, must equal the reference's exactly; the losses agree within rounding.

A pipeline run's routing samples (`train.record_routing_every`, the input of Lina's path profile) are the
stages' layers gathered along rank 0's chain: they must equal the reference's last micro-batch's expert ids
exactly, also on the step a migration moves layers and on the step a re-pack releases a stage.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from moebal.distributed.testing import run_ranks
from moebal.train.routing_log import load_routing
from tests.distributed.test_pipeline import _train, reference_losses, tiny
from tests.distributed.test_selection_bias import assert_bias_rule

STEPS = 5


def _biased(pp: int, nproc: int, ep: int | None = None):
    cfg = tiny(n_layers=4, pp=pp, moe=4, nproc=nproc)
    # compared exactly with the one-process loop: expert shards place replicas on a fixed profile, not on costs
    # measured at start-up (which differ between runs and may move an expert's rows to another rank's GEMM)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=0.05),
                               parallel=dataclasses.replace(cfg.parallel, ep=ep),
                               planner=dataclasses.replace(cfg.planner, costs="a100"))


def _run(cfg, scheme: str = "none") -> dict:
    out = _train(cfg, STEPS, scheme, {} if scheme != "none" else None, micro_batches=2)
    return {"losses": out["losses"], "counts": [r["expert_counts"] for r in out["records"]],
            "imbalance": [r["load_imbalance"] for r in out["records"]],
            "bias": {k: v for k, v in out["state"].items() if k.endswith("expert_bias")}}


def _two_ranks(rank: int, world: int) -> dict:
    return {"two_stages": _run(_biased(2, 2)),
            "expert_parallel": _run(_biased(1, 2, ep=2), "moe"),  # one stage of two expert shards
            "data_parallel": _run(_biased(1, 2, ep=1), "moe")}  # one stage, two data-parallel copies


@pytest.fixture(scope="module")
def runs() -> dict:
    ranks = run_ranks(_two_ranks, 2)
    for layout, run in ranks[0].items():  # a stage's rank holds its own layers' biases
        for other in ranks[1:]:
            for name, bias in other[layout]["bias"].items():
                if name in run["bias"]:  # held by both: the same bias on every rank of the stage
                    np.testing.assert_array_equal(run["bias"][name], bias, err_msg=f"{layout} {name}")
                run["bias"][name] = bias
    return ranks[0]


@pytest.fixture(scope="module")
def reference() -> dict:
    counts: list = []
    routing: list = []
    losses, state = reference_losses(_biased(1, 1), STEPS, micro=2, counts=counts, routing=routing)
    return {"losses": losses, "counts": counts, "routing": routing,
            "bias": {k: v.numpy() for k, v in state.items() if k.endswith("expert_bias")}}


def _recorded(rank: int, cfg, out: Path, force: tuple = ()) -> list[np.ndarray] | None:
    """A pipeline run through the trainer with the routing recorder on every step; rank 0 reads the samples."""
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import pipeline_ep
    from moebal.train.pipelined import pipeline_trainer
    from moebal.train.routing_log import RoutingRecorder

    # train.steps stays the reference's (the learning-rate schedule depends on it); the run trains one step more
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, record_routing_every=1, ckpt_every=0,
                                                             time_limit_min=None),
                              pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2))
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, rank=rank, pp=cfg.parallel.pp, ep=pipeline_ep(cfg, world)).init()
    trainer = pipeline_trainer(cfg, out, dims=dims, hooks=[RoutingRecorder(1)], force=force)
    try:
        trainer.train()
    finally:
        trainer.close()
    dist.barrier()  # a released rank waits here for the survivor
    return load_routing(out) if rank == 0 else None


def _three_stages(rank: int, world: int, tmp: str) -> list[np.ndarray] | None:
    # layers 0-1 | 2 | 3, then 0 | 1 | 2-3 after step 2 (a migration), then 0-1 | 2-3 on two ranks after step 3
    # (a re-pack releases the last rank)
    return _recorded(rank, _biased(3, 3), Path(tmp), force=((2, (1, 1, 2)), (3, (2, 2))))


def _expert_shards(rank: int, world: int, tmp: str) -> list[np.ndarray] | None:
    cfg = _biased(1, 2, ep=2)  # one stage (the moe scheme's) of two expert shards
    return _recorded(rank, dataclasses.replace(cfg, dynamism=dataclasses.replace(cfg.dynamism, scheme="moe")),
                     Path(tmp))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    return {"three_stages": run_ranks(_three_stages, 3, str(tmp_path_factory.mktemp("pp3")), timeout_s=300)[0],
            "expert_shards": run_ranks(_expert_shards, 2, str(tmp_path_factory.mktemp("ep2")), timeout_s=300)[0]}


def test_a_pipeline_records_the_routing_of_every_stage_s_layers(recorded, reference):
    samples = recorded["three_stages"]
    assert len(samples) == STEPS + 1  # every step recorded
    for step, (got, ref) in enumerate(zip(samples[:STEPS], reference["routing"], strict=True), start=1):
        assert ref.shape == (4, 4 * 16, 2)  # 4 MoE layers, the last micro-batch's 4 rows of 16 tokens, top-2
        np.testing.assert_array_equal(got, ref, err_msg=f"step {step}")  # migration after 2, re-pack after 3
    # two expert shards of one stage split each micro-batch's rows: rank 0 records its half, as without a pipeline
    shards = recorded["expert_shards"][:STEPS]
    for step, (got, ref) in enumerate(zip(shards, reference["routing"], strict=True), start=1):
        np.testing.assert_array_equal(got, ref[:, :2 * 16], err_msg=f"step {step}")


@pytest.mark.parametrize("layout", ["two_stages", "expert_parallel", "data_parallel"])
def test_the_selection_bias_steps_in_a_pipeline_as_in_the_single_process_loop(runs, reference, layout):
    got = runs[layout]
    assert got["counts"] == reference["counts"], layout  # every step's counts, every MoE layer, exactly
    assert sorted(got["bias"]) == sorted(reference["bias"]) and len(got["bias"]) == 4
    for name, ref in reference["bias"].items():
        assert np.abs(ref).max() > 0, name  # the bias moved
        np.testing.assert_array_equal(got["bias"][name], ref, err_msg=f"{layout} {name}")
    assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(got["losses"], reference["losses"], strict=True))
    assert_bias_rule(got["bias"], got["counts"], 0.05, layout)  # DeepSeek-V3's rule on the logged counts


def test_a_pipeline_step_records_the_routing_summary(runs, reference):
    rec = runs["two_stages"]
    assert len(rec["counts"]) == STEPS and all(len(step) == 4 for step in rec["counts"])  # every MoE layer
    tokens = 8 * 16 * 2  # batch x seq_len x top_k assignments per layer and step
    assert all(sum(layer) == tokens for step in rec["counts"] for layer in step)
    for step, imb in zip(rec["counts"], rec["imbalance"]):
        assert imb == [round(max(c) / (sum(c) / len(c)), 4) for c in step]
