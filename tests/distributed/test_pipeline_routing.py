"""The pipeline's per-step routing point (`StageExperts._take_routing`): the auxiliary-loss-free selection bias
(`moe.bias_update_rate`, DeepSeek-V3) steps once per optimizer step on the stage's summed gate assignments, and
every step's record carries the routing summary of the trainer without a pipeline (loads, drops, expert counts).

Reference: the single-process loop over the same micro-batches with the same bias rule
(`tests/distributed/test_pipeline.py` `reference_losses`). Expert counts are integers, so they, and the biases
that follow from them, must equal the reference's exactly; the losses agree within rounding.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline import _train, reference_losses, tiny
from tests.distributed.test_selection_bias import assert_bias_rule

STEPS = 5


def _biased(pp: int, nproc: int, ep: int | None = None):
    cfg = tiny(n_layers=4, pp=pp, moe=4, nproc=nproc)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=0.05),
                               parallel=dataclasses.replace(cfg.parallel, ep=ep))


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
    losses, state = reference_losses(_biased(1, 1), STEPS, micro=2, counts=counts)
    return {"losses": losses, "counts": counts,
            "bias": {k: v.numpy() for k, v in state.items() if k.endswith("expert_bias")}}


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
