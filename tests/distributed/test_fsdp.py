"""`parallel.shard: full` (FSDP2 for dense state, the sharded optimizer for expert state) against unsharded
training on gloo ranks: 20 steps, losses, gradient norms and parameters within 1e-5 relative (fp32); data
parallel, expert parallel, Pro-Prophet replicas; resume 1 -> 2 -> 4 shards; the bf16 policy."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from moebal.config import from_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.shard_parity import (
    RESUME_STEPS,
    STEPS,
    check_parity,
    checkpoint_state,
    clip_probe,
    leg,
    pair,
    rel,
    shard_cfg,
    train_run,
)


@pytest.mark.parametrize("world, ep, policy", [(2, 1, "static"), (4, 2, "prophet")])
def test_full_sharding_matches_unsharded_for_10_steps(tmp_path, world, ep, policy):
    """[2-1-static]: everything under FSDP2. [4-2-prophet]: ep 2 x dp 2, dense state over 4 ranks, expert
    gradients and moments over 2, and expert weights sharded at rest over 2 (both MoE layers), with Pro-Prophet
    replicas (Trans at step start gathers each layer's weights and frees them after copying; Agg adds into the
    owner's whole gradient before the reduce-scatter)."""
    out = run_ranks(pair, world, str(tmp_path), ep, policy, "full", timeout_s=900)
    if policy == "prophet":
        assert any(sum(r["replicas"]) > 0 for r in out[0]["full"])  # Trans and Agg ran
        assert all(r["at_rest"] == 2 for r in out)
    check_parity(out, "full")


def test_full_sharding_keeps_tied_embeddings_one_weight(tmp_path):
    """`model.tie_embeddings` under FSDP2 without a pipeline: the embedding and the head are sharded under the
    model's root, so the tied weight stays one (a pipeline stage shards them apart, which the config check
    refuses): 6 steps on 2 ranks within 1e-5 of unsharded, the head's weight included."""
    tied = {"model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32,
                      "tie_embeddings": True}}
    out = run_ranks(pair, 2, str(tmp_path), 1, "static", "full", 6, {"sections": tied}, timeout_s=600)
    check_parity(out, "full", steps=6)


AHEAD = {"planner": {"plan_ahead": "path", "path_len": 1, "path_refresh": 1, "path_window": 2}}
"""Layer 1's placement planned during layer 0 and its Trans issued there: the expert weights at rest prefetched
as layer 0 starts, kept for layer 1's forward."""


def test_full_sharding_with_prophet_replicas_planned_ahead_matches_unsharded(tmp_path):
    """Pro-Prophet replicas on 4 ranks (ep 2 x dp 2: expert weights at rest) with plan-ahead (`AHEAD`), 20 steps
    within 1e-5 of the unsharded run with the same settings."""
    out = run_ranks(pair, 4, str(tmp_path), 2, "prophet", "full", STEPS, {"sections": AHEAD}, timeout_s=900)
    assert any(sum(r["replicas"]) > 0 for r in out[0]["full"])  # Trans and Agg ran
    assert all(r["at_rest"] == 2 for r in out)
    check_parity(out, "full")


def test_full_sharding_with_recompute_matches_unsharded(tmp_path):
    """`train.recompute: full` under FSDP2 (its backward re-gathers a layer whose forward is replayed; the replay
    gathers the layer's expert weights at rest again) with Pro-Prophet replicas and block overlap (Trans of layer
    i+1 as layer i starts: it gathers layer i+1's weights, kept for its forward): 6 steps on 4 ranks (ep 2 x dp
    2) within 1e-5 of unsharded with the same settings."""
    more = {"recompute": "full", "sections": {"scheduler": {"block_overlap": True}}}
    out = run_ranks(pair, 4, str(tmp_path), 2, "prophet", "full", 6, more, timeout_s=900)
    assert any(sum(r["replicas"]) > 0 for r in out[0]["full"])  # Trans and Agg ran
    assert all(r["at_rest"] == 2 for r in out)
    check_parity(out, "full", steps=6)


# ---- checkpoints: resume across shard sizes ------------------------------------------------------------------


def writers(manifest: dict[str, Any]) -> set[str]:
    """The files that hold optimizer state (a tensor written whole, or each of its row pieces)."""
    return {p["file"] for k, e in manifest["tensors"].items() if ":" in k for p in e.get("pieces", [e])}


def test_resume_full_across_shard_sizes_1_2_4_and_back_to_unsharded(tmp_path):
    """One process for 2 steps, then 2 ranks under full (ep 2: dense state in 2 shards), then 4 ranks under full
    (ep 2: dense state in 4 shards, experts in 2, expert weights at rest: the checkpoint loaded into their parts
    and the next one written from them gathered; the planner's costs measured at start-up, which computes with
    them gathered), then one unsharded process for the last 2 steps, against one uninterrupted process: losses,
    weights and AdamW moments within 1e-5."""
    whole = run_ranks(leg, 1, str(tmp_path / "whole"), "none", None, False, None, 5, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(leg, 1, run, "none", None, False, 2, 5, timeout_s=600)
    run_ranks(leg, 2, run, "full", 2, True, 4, 5, timeout_s=600)
    mid = json.loads((Path(run) / "ckpt-0000004" / "manifest.json").read_text())
    assert len(writers(mid)) == 2  # both ranks wrote AdamW state
    run_ranks(leg, 4, run, "full", 2, True, 5, 5, {"planner": {"costs": "measure"}}, timeout_s=600)
    late = json.loads((Path(run) / "ckpt-0000005" / "manifest.json").read_text())
    assert len(writers(late)) >= 2  # expert owners wrote theirs
    run_ranks(leg, 1, run, "none", None, True, None, 5, timeout_s=600)
    resumed = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert sorted(losses) == list(range(1, RESUME_STEPS + 1))
    for a in whole:
        assert math.isclose(a["loss"], losses[a["step"]], rel_tol=1e-5), (a["step"], a["loss"], losses[a["step"]])
    for step in (4, RESUME_STEPS):  # written under full on 2 ranks; unsharded from the 4-rank leg's state
        ref, got = (checkpoint_state(Path(d) / f"ckpt-{step:07d}") for d in (tmp_path / "whole", run))
        assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") for k in ref)
        worst = max(rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
        assert worst < 1e-5, (step, worst)


def test_full_sharding_checkpoints_are_written_by_each_owner_and_resume_unsharded(tmp_path):
    """ep 1 on 2 ranks: FSDP2 shards the dense and the stacked expert tensors. A checkpoint holds no gathered copy:
    each rank writes its rows, dense tensors as row pieces of their logical names, experts (and their moments) as
    whole logical experts, and loads only its rows. Unsharded 2 steps, full 2 steps, unsharded 2 steps against the
    uninterrupted unsharded run (the same 2 data-parallel ranks: a 1-process run's routing losses see the whole
    batch): losses, weights and moments within 1e-5."""
    whole = run_ranks(leg, 2, str(tmp_path / "whole"), "none", 1, False, None, 5, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(leg, 2, run, "none", 1, False, 2, 5, timeout_s=600)
    run_ranks(leg, 2, run, "full", 1, True, 4, 5, timeout_s=600)
    mid = json.loads((Path(run) / "ckpt-0000004" / "manifest.json").read_text())
    q = mid["tensors"]["model.layers.0.self_attn.q_proj.weight:exp_avg"]
    assert [p["rows"] for p in q["pieces"]] == [[0, 16], [16, 32]] and "file" not in q
    assert len({p["file"] for p in q["pieces"]}) == 2  # each owner wrote its rows
    experts = [k for k in mid["tensors"] if ".experts." in k and k.endswith(":exp_avg")]
    assert len(experts) == 2 * 3 * 4  # per logical expert: 2 layers x w1, w2, w3 x 4 experts
    assert {mid["tensors"][k]["file"] for k in experts} == {"optim-r00000.safetensors", "optim-r00001.safetensors"}
    ref, got = (checkpoint_state(Path(d) / "ckpt-0000004") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys()
    assert max(rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0) < 1e-5
    run_ranks(leg, 2, run, "none", 1, True, None, 5, timeout_s=600)
    losses = {r["step"]: r for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert sorted(losses) == list(range(1, RESUME_STEPS + 1))
    for a in whole:
        b = losses[a["step"]]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])


def _clip_below(rank: int, world: int) -> dict[str, Any]:
    """`FullyShardedAdamW.clip_grad_norm` after one backward pass on 2 ranks (ep 2: FSDP2 dense shards over both,
    each rank's experts in the sharded optimizer): a max_norm above the norm keeps every dense shard and expert
    part of the gradient as it was, bit for bit; one below scales them to it."""
    import torch
    import torch.distributed as dist

    from moebal.distributed.expert_parallel import ExpertParallel
    from moebal.distributed.fsdp import FullyShardedAdamW, fully_shard_model
    from moebal.distributed.groups import ParallelDims
    from moebal.models import build_model

    torch.set_num_threads(1)
    cfg = shard_cfg("full", 2)
    dims = ParallelDims(world_size=world, rank=rank, ep=2).init()
    torch.manual_seed(0)
    model = build_model(cfg)
    ep = ExpertParallel(model, dims, sync_gradients=False)
    fully_shard_model(model, cfg, dims)
    opt = FullyShardedAdamW(model, cfg, dims)
    assert opt.experts is not None
    ids = torch.randint(0, 256, (2 * world, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[2 * rank:2 * rank + 2, :-1], ids[2 * rank:2 * rank + 2, 1:]
    opt.begin()
    out = model(x, y)
    (out.loss + out.aux_loss).backward()
    ep.sync_gradients()
    opt.reduce()

    def grads() -> list[torch.Tensor]:
        expert = [leaf.grad for fl in opt.experts.flats for leaf in fl.leaves if leaf.grad is not None]
        return [g.clone() for g in opt._dense_grads() + expert]

    out = clip_probe(opt, grads)
    opt.close()
    dist.barrier()
    return out


def test_full_sharding_clip_with_the_norm_below_max_norm_changes_no_gradient():
    """torch's clip_grad_norm_ rule: the coefficient max_norm / norm is clamped at 1 (never scales gradients up)."""
    for r in run_ranks(_clip_below, 2):
        assert 0 < r["norm"] < r["above"], r
        assert r["kept"], r
        assert math.isclose(r["scaled"], r["norm"] / 4, rel_tol=1e-5), r


# ---- mixed precision -----------------------------------------------------------------------------------------

BF16_STEPS = 6


def _bf16(rank: int, world: int, root: str) -> dict[str, Any]:
    fp32 = train_run(shard_cfg("full", 2, steps=BF16_STEPS), Path(root) / "fp32")
    bf16 = train_run(shard_cfg("full", 2, steps=BF16_STEPS, precision="bf16",
                       parallel={"param_dtype": "bf16", "reduce_dtype": "bf16"}), Path(root) / "bf16")
    return {"fp32": fp32["rows"], "bf16": bf16["rows"], "compute": (fp32["compute"], bf16["compute"]),
            "master": sorted({str(p.dtype) for p in bf16["params"].values()})}


def test_full_sharding_bf16_policy_runs_close_to_fp32(tmp_path):
    """bf16 weights for compute and bf16 reduce-scatters on 2 ranks (ep 2), 6 steps: every loss finite and
    within 2 % of the fp32 run's (a loose bound: bf16 keeps 8 bits of mantissa, ~0.4 % per rounding, and the runs
    drift apart over the steps; measured 1.5e-4 at most); the forward computes with bf16 dense weights, the
    master weights stay fp32."""
    out = run_ranks(_bf16, 2, str(tmp_path), timeout_s=900)[0]
    assert out["compute"] == (["torch.float32"], ["torch.bfloat16"])
    assert out["master"] == ["torch.float32"]
    assert len(out["bf16"]) == BF16_STEPS
    for a, b in zip(out["fp32"], out["bf16"]):
        assert math.isfinite(b["loss"]) and math.isfinite(b["grad_norm"])
        assert math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a["step"], a["loss"], b["loss"])
    assert out["fp32"] != out["bf16"]  # the policy changed the computation


def test_full_sharding_refusals_name_the_fix():
    from moebal.errors import ConfigError

    assert from_dict({"parallel": {"pp": 2, "shard": "full"}, "model": {"n_layers": 2}}).parallel.shard == "full"
    assert from_dict({"parallel": {"pp": 2, "shard": "full"}, "pipeline": {"schedule": "zb"},
                      "model": {"n_layers": 2}}).pipeline.schedule == "zb"
    assert from_dict({"parallel": {"pp": 2, "shard": "full"}, "dynamism": {"scheme": "mod"},
                      "model": {"n_layers": 2}}).dynamism.scheme == "mod"
    with pytest.raises(ConfigError, match="mixed-precision policy: set parallel.shard=full"):
        shard_cfg("none", 2, parallel={"reduce_dtype": "bf16"})
    with pytest.raises(ConfigError, match="set train.precision=bf16"):
        shard_cfg("full", 2, parallel={"param_dtype": "bf16"})
    assert shard_cfg("full", 2, parallel={"reduce_dtype": "bf16"}).parallel.reduce_dtype == "bf16"
