"""Gradient accumulation (`train.grad_accum`) in the data- and expert-parallel trainer, against one pass over
the same rows: losses, gradient norms and final parameters within 1e-5 relative (fp32), under every gradient
path that sends during or after the backward pass, with Pro-Prophet's replicas and plan-ahead; one process
accumulating against data-parallel ranks holding the same rows; exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import counting_collectives, rel, shard_cfg, train_run

STEPS = 8
NO_AUX = {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.0}
"""The balancing loss is each forward's (a product of the micro-batch's means, not of the step's), so a step of
micro-batches optimises another loss than one pass: without it the gradients are the same sum."""

VARIANTS: dict[str, tuple[int, str, str, dict[str, Any]]] = {
    # name: (ranks, parallel.shard, planner.policy, more sections); ep 2 (4 ranks: 2 copies of each expert shard)
    "static": (2, "none", "static", {}),
    "prophet, lina scheduler": (2, "none", "prophet", {"scheduler": {"mode": "lina", "chunk_mb": 0.002}}),
    "prophet, plan-ahead": (2, "none", "prophet", {"planner": {"plan_ahead": "path", "path_len": 1,
                                                            "path_refresh": 2, "path_window": 4}}),
    "prophet, shard optimizer": (2, "optimizer", "prophet", {}),
    "prophet, shard full": (2, "full", "prophet", {}),
    "prophet, block overlap": (2, "none", "prophet", {"scheduler": {"block_overlap": True}}),
    "4 ranks, shard optimizer": (4, "optimizer", "prophet", {}),
    "4 ranks, shard optimizer, bf16 weights": (4, "optimizer", "prophet", {"parallel": {"param_dtype": "bf16"},
                                                                           "train": {"precision": "bf16"}}),
    "4 ranks, shard full, block overlap": (4, "full", "prophet", {"scheduler": {"block_overlap": True}}),
    "4 ranks, shard full (experts at rest)": (4, "full", "prophet", {}),
    "prophet, shard full, whole sums": (2, "full", "prophet", {"parallel": {"accumulate": "whole"}}),
    "4 ranks, shard full, whole sums, weights per step, block overlap, experts at rest": (
        4, "full", "prophet", {"parallel": {"accumulate": "whole", "reshard": "step"},
                               "scheduler": {"block_overlap": True}}),
}


def _accumulating_pair(rank: int, world: int, root: str, name: str) -> dict[str, Any]:
    """Expert parallelism over 2 ranks (on 4: two copies): one pass over each rank's rows, then 2 micro-batches."""
    _, shard, policy, sections = VARIANTS[name]
    runs = {}
    extra = {k: v for k, v in sections.items() if k not in ("parallel", "train")}
    for A in (1, 2):
        cfg = shard_cfg(shard, 2, policy, STEPS, parallel=sections.get("parallel"), sections={**extra, "moe": NO_AUX},
                        **{**sections.get("train", {}), "grad_accum": A})
        runs[A] = train_run(cfg, Path(root) / f"accum{A}")
    p, q = runs[1]["params"], runs[2]["params"]
    assert p.keys() == q.keys()
    return {"one": runs[1]["rows"], "accum": runs[2]["rows"], "param_rel": max(rel(q[n], p[n]) for n in p),
            "at_rest": runs[2]["at_rest"]}


def _close(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, len(a) + 1))
    for x, y in zip(a, b):
        assert math.isclose(x["loss"], y["loss"], rel_tol=tol), (x["step"], x["loss"], y["loss"])
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=tol), (x["step"], x["grad_norm"], y["grad_norm"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_micro_batches_train_as_one_pass_under_expert_parallelism(tmp_path, name):
    out = run_ranks(_accumulating_pair, VARIANTS[name][0], str(tmp_path), name, timeout_s=600)
    one, accum = out[0]["one"], out[0]["accum"]
    # bf16 weights: each pass's gradients arrive rounded to bf16 (one pass: the sum is rounded once); a pass left
    # out or counted twice would be off by far more
    tol, param_tol = (2e-3, 5e-2) if "bf16" in name else (1e-5, 1e-5)
    _close(one, accum, tol)
    assert max(r["param_rel"] for r in out) < param_tol, [r["param_rel"] for r in out]
    assert any(r["grad_norm"] > 0.5 for r in one)  # the clip acted
    if "at rest" in name:
        assert out[0]["at_rest"] == 2  # both MoE layers' experts sharded between uses (ZeRO-3)
    if VARIANTS[name][2] == "prophet":
        assert sum(sum(r["replicas"]) for r in accum) > 0  # Trans and Agg ran
    if "plan-ahead" in name:
        assert any(r.get("plan_ahead_layers") for r in accum)  # layers were planned ahead of their gate


HOLDS: dict[str, tuple[str, dict[str, str]]] = {
    # name: (weights' dtype, parallel settings against the default's)
    "whole sums": ("fp32", {"accumulate": "whole"}),
    "whole sums, bf16 weights": ("bf16", {"accumulate": "whole"}),
    "weights gathered per step": ("fp32", {"reshard": "step"}),
    "whole sums, weights gathered per step": ("fp32", {"accumulate": "whole", "reshard": "step"}),
}


def _against_default(rank: int, world: int, root: str, A: int, name: str) -> dict[str, Any]:
    """`shard: full` in A micro-batches under the default (FSDP2 gathers each unit's weights for every forward and
    backward pass and reduce-scatters each pass's dense gradients) and under `HOLDS[name]`; every reduce-scatter
    and all-gather counted (FSDP2's and the expert optimizer's). bf16 weights: FSDP2 upcasts each pass's bf16
    gradients into its fp32 whole sums."""
    dtype, held = HOLDS[name]
    runs, counts = {}, {}
    for how, parallel in (("default", {}), ("held", held)):
        cfg = shard_cfg("full", 2, "prophet", STEPS, parallel={**parallel, "param_dtype": dtype},
                        sections={"moe": NO_AUX}, grad_accum=A, precision=dtype)
        with counting_collectives() as calls:
            runs[how] = train_run(cfg, Path(root) / how)
        counts[how] = dict(calls)
    p, q = runs["default"]["params"], runs["held"]["params"]
    return {"default": runs["default"]["rows"], "held": runs["held"]["rows"], "counts": counts,
            "param_rel": max(rel(q[n], p[n]) for n in p)}


@pytest.mark.parametrize("name", list(HOLDS))
def test_what_fsdp2_holds_through_a_step_changes_its_traffic_not_the_training(tmp_path, name):
    """`parallel.accumulate: whole` and `parallel.reshard: step` against the default under `shard: full`, 4
    micro-batches: the same training (a sum of sums in another order: within 1e-6; with bf16 weights, whose
    compute rounds the small differences of the summation order step after step, 1e-3), and FSDP2's collectives
    per step: whole sums reduce-scatter each unit (2 layers and the root) once instead of once per micro-batch;
    kept weights all-gather each unit once instead of each layer per forward and backward pass and the root
    (which keeps its weights from its forward to its backward) per forward."""
    A, layers, units = 4, 2, 3
    out = run_ranks(_against_default, 2, str(tmp_path), A, name, timeout_s=600)
    tol = 1e-3 if "bf16" in name else 1e-6
    _close(out[0]["default"], out[0]["held"], tol=tol)
    assert max(r["param_rel"] for r in out) < tol, [r["param_rel"] for r in out]
    held = HOLDS[name][1]
    for r in out:
        c = r["counts"]
        saved_rs = c["default"]["reduce_scatter_single"] - c["held"]["reduce_scatter_single"]
        saved_ag = c["default"]["all_gather_single"] - c["held"]["all_gather_single"]
        assert saved_rs == (STEPS * units * (A - 1) if held.get("accumulate") == "whole" else 0), c
        assert saved_ag == (STEPS * (2 * A * layers + A - units) if held.get("reshard") == "step" else 0), c


# documents cut at seq_len: rows of different lengths, so the ranks' halves hold different token counts (a mean
# of the ranks' means, or of their balancing losses, differs from the global batch's)
UNEVEN = {"data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000, "samples": "documents", "units": "blocks"},
          "moe": {**NO_AUX, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}}


def _data_parallel(rank: int, world: int, root: str, ep: int) -> list[dict[str, Any]]:
    out = train_run(shard_cfg("none", ep, steps=STEPS, sections=UNEVEN), Path(root))
    torch.save(out["params"], Path(root) / f"params{rank}.pt")
    return list(out["rows"])


@pytest.mark.parametrize("ep", [1, 2])
def test_ranks_equal_one_process_over_the_global_batch_with_uneven_tokens_and_the_balancing_loss(tmp_path, ep):
    """2 ranks (experts replicated, or split over them) against one process over the whole batch in one pass,
    on documents (the ranks hold different token counts): the loss is token-weighted over the ranks and the
    balancing and z losses come from the global batch's statistics (summed over the ranks), so the runs agree."""
    ref = run_ranks(_data_parallel, 2, str(tmp_path / "dp"), ep, timeout_s=600)[0]
    one = train_run(shard_cfg("none", None, steps=STEPS, sections=UNEVEN), tmp_path / "one")
    _close(ref, one["rows"], tol=1e-6)
    assert all(r["aux_loss"] > 0 for r in one["rows"])
    parts = [torch.load(tmp_path / "dp" / f"params{r}.pt") for r in range(2)]
    # under expert parallelism each rank holds half of every stacked expert tensor: the two halves, in rank order
    params = {n: p if p.shape == one["params"][n].shape else torch.cat([p, parts[1][n]]) for n, p in parts[0].items()}
    assert max(rel(one["params"][n], params[n]) for n in params) < 1e-5


def test_an_accumulating_run_resumes_bit_for_bit(tmp_path):
    cfg = shard_cfg("none", None, steps=6, grad_accum=4, ckpt_every=2)
    whole = train_run(cfg, tmp_path / "whole")["rows"]
    train_run(cfg, tmp_path / "split", stop=3)
    resumed = train_run(cfg, tmp_path / "split", resume=True)["rows"]
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [(r["step"], r["loss"], r["grad_norm"])
                                                                      for r in whole]
    assert [r["step"] for r in resumed] == list(range(1, 7))
