"""Pipeline checkpoints of every dynamism scheme, and of a re-packed job, resume exactly.

A run is interrupted after its step-3 checkpoint (a copy of the uninterrupted run's directory without the
later checkpoint) and resumed; its losses must equal the uninterrupted run's: bitwise under the same layout,
and under another number of stages too (a pipeline's losses do not depend on its partition or stage count:
every sum goes layer by layer in model order); with data-parallel replicas, which split each micro-batch's
rows, within the resharding tests' 1e-5 relative. Several pipelines run in one spawned job
(`pipeline_trainer(dims=...)`), 4 ranks then 2, on a tiny dense 4-layer model, 6 steps each.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks

SCHEMES = {  # each sets in before the step-3 checkpoint and acts again after it
    "freezing": {"threshold": 0.5, "check_every": 2, "max_fraction": 0.5},
    "pruning": {"start": 0, "every": 2, "steps": 2, "final_sparsity": 0.8, "kernel": "csr"},
    "early_exit": {"threshold": 0.995, "first_layer": 1, "start": 1, "ramp_steps": 2},
    "mod": {"capacity": 0.5, "every": 2, "first_layer": 1},
    "moe": {},
}


def cfg_for(pp: int, nproc: int, scheme: str = "none", moe: int = 0, **pipeline) -> Config:
    moe = 4 if scheme == "moe" else moe
    dyn = {"scheme": scheme, **({scheme: SCHEMES[scheme]} if scheme in SCHEMES else {})}
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        # the moe scheme's model also steps its selection bias: a resumed run must route with the saved one
        "moe": {"num_experts": moe, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop",
                "bias_update_rate": 0.05 if scheme == "moe" else 0.0},
        "data": {"seq_len": 16, "batch_size": 4, "max_bytes": 200_000},
        "train": {"steps": 6, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32", "threads": 1,
                  "ckpt_every": 3, "keep_checkpoints": 10},
        "parallel": {"pp": pp, "nproc": nproc}, "dynamism": dyn,
        # expert placement from a hardware profile, not from timing this job (two runs would place differently)
        "planner": {"costs": "a100"},
        "pipeline": {"micro_batches": 2, **pipeline}})


def _run(rank: int, cfg: Config, out: Path, resume: bool = False, force: tuple = ()) -> list[dict] | None:
    """One pipeline run of the spawned job; rank 0 returns its metrics lines. `force`: partitions adopted after
    the given steps (the runner's `force` keyword, which the config does not expose)."""
    import torch.distributed as dist

    from moebal.distributed.groups import ParallelDims
    from moebal.pipeline.runner import pipeline_ep
    from moebal.train.pipelined import pipeline_trainer

    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, rank=rank, pp=cfg.parallel.pp, ep=pipeline_ep(cfg, world)).init()
    trainer = pipeline_trainer(cfg, out, resume=resume, dims=dims, force=force)
    try:
        trainer.train()
    finally:
        trainer.close()
    dist.barrier()  # released ranks wait here for the survivors
    if rank != 0:
        return None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume(rank: int, runs: dict, key: str, cfg: Config, out: Path, force: tuple = ()) -> None:
    """`runs[key]`: the metrics lines of `out` resumed; `runs[key + "_started"]`: when the resume started."""
    started = time.time()
    runs[key] = _run(rank, cfg, out, resume=True, force=force)
    runs[f"{key}_started"] = started


def _interrupted(rank: int, whole: Path, to: Path) -> Path:
    """The run `whole` as it stood after its step-3 checkpoint (rank 0 copies; every rank waits)."""
    import torch.distributed as dist

    if rank == 0:
        shutil.copytree(whole, to)
        shutil.rmtree(to / "ckpt-0000006")
    dist.barrier()
    return to


def _four(rank: int, world: int, tmp: str) -> dict:
    base, out = Path(tmp), {}
    for scheme in ("freezing", "pruning"):
        whole = base / scheme / "whole"
        out[f"{scheme}_whole"] = _run(rank, cfg_for(4, 4, scheme), whole)
        _resume(rank, out, f"{scheme}_same", cfg_for(4, 4, scheme), _interrupted(rank, whole, base / scheme / "same"))
        if scheme == "pruning":  # 2 stages x 2 data-parallel replicas
            _resume(rank, out, f"{scheme}_2x2", cfg_for(2, 4, scheme),
                    _interrupted(rank, whole, base / scheme / "2x2"))
    # expert-parallel: 2 stages x 2 expert shards; the snapshots of expert rows go by logical expert
    out["freezing_ep_whole"] = _run(rank, cfg_for(2, 4, "freezing", moe=4), base / "freezing_ep" / "whole")
    # ... and the masks of expert rows
    whole = base / "pruning_ep" / "whole"
    out["pruning_ep_whole"] = _run(rank, cfg_for(2, 4, "pruning", moe=4), whole)
    _resume(rank, out, "pruning_ep_same", cfg_for(2, 4, "pruning", moe=4),
            _interrupted(rank, whole, base / "pruning_ep" / "same"))
    repack = {"repack": True, "repack_slack": 100.0, "every": 2}  # re-packs onto 2 of the 4 ranks at step 2
    whole = base / "repack" / "whole"
    out["repack_whole"] = _run(rank, cfg_for(4, 4, **repack), whole)
    _resume(rank, out, "repack_same", cfg_for(4, 4, **repack), _interrupted(rank, whole, base / "repack" / "same"))
    return out


def _two(rank: int, world: int, tmp: str) -> dict:
    base, out = Path(tmp), {}
    # onto the 2 ranks still training when the checkpoint was written / a 4-stage checkpoint onto 2 stages
    _resume(rank, out, "repack_two", cfg_for(2, 2), _interrupted(rank, base / "repack" / "whole",
                                                                base / "repack" / "two"))
    for scheme in ("freezing", "pruning"):
        _resume(rank, out, f"{scheme}_two", cfg_for(2, 2, scheme), _interrupted(rank, base / scheme / "whole",
                                                                                base / scheme / "two"))
    # ... resumed without expert parallelism (each stage holds all 4 experts)
    _resume(rank, out, "freezing_ep_two", cfg_for(2, 2, "freezing", moe=4), _interrupted(
        rank, base / "freezing_ep" / "whole", base / "freezing_ep" / "two"))
    _resume(rank, out, "pruning_ep_two", cfg_for(2, 2, "pruning", moe=4), _interrupted(
        rank, base / "pruning_ep" / "whole", base / "pruning_ep" / "two"))
    for scheme in ("early_exit", "mod", "moe"):
        whole = base / scheme / "whole"
        out[f"{scheme}_whole"] = _run(rank, cfg_for(2, 2, scheme), whole)
        _resume(rank, out, f"{scheme}_same", cfg_for(2, 2, scheme), _interrupted(rank, whole, base / scheme / "same"))
    # split partition units: layer 1's halves on different stages from step 2 (a forced partition: the tiny
    # model's planner keeps its stages), so the step-3 checkpoint holds half-held layers
    whole = base / "split" / "whole"
    cut = ((2, (3, 5)),)  # 0a 0f 1a | 1f 2a 2f 3a 3f
    out["split_whole"] = _run(rank, cfg_for(2, 2, split_layers=True), whole, force=cut)
    _resume(rank, out, "split_same", cfg_for(2, 2, split_layers=True),
            _interrupted(rank, whole, base / "split" / "same"), force=cut)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("resume"))
    four = run_ranks(_four, 4, tmp, timeout_s=300)[0]
    two = run_ranks(_two, 2, tmp, timeout_s=300)[0]
    return {**four, **two, "tmp": tmp}


def test_every_resumed_run_trained_its_own_steps(runs):
    """The resumed directories start as copies of the uninterrupted run's (its metrics.jsonl included): the
    lines after the step-3 checkpoint must be the resumed run's own, written after it started, and the
    checkpoint's earlier lines kept."""
    resumed = [k.removesuffix("_started") for k in runs if k.endswith("_started")]
    assert len(resumed) == 14, resumed
    for key in resumed:
        lines, started = runs[key], runs[f"{key}_started"]
        assert [r["step"] for r in lines] == list(range(1, 7)), key
        assert all(r["time"] < started for r in lines[:3]), key
        assert all(r["time"] >= started for r in lines[3:]), key


def _losses(lines: list[dict]) -> list[float]:
    assert [r["step"] for r in lines] == list(range(1, 7))
    return [r["loss"] for r in lines]


@pytest.mark.parametrize("scheme", ["freezing", "pruning"])
def test_freezing_and_pruning_resume_exactly_under_any_number_of_stages(runs, scheme):
    whole = runs[f"{scheme}_whole"]
    key = {"freezing": "frozen_layers", "pruning": "sparsity_target"}[scheme]
    # the scheme acted before the step-3 checkpoint, and its saved state decides what follows: freezing's
    # next check compares against the step-2 snapshots of the layers not frozen yet, pruning prunes again
    assert whole[2][key] > 0, [r[key] for r in whole]
    if scheme == "freezing":
        assert whole[3]["plasticity"] != whole[2]["plasticity"] and whole[3]["plasticity"][-1] > 0
    else:
        assert whole[5][key] > whole[2][key]
    for case in ("same", "2x2", "two") if scheme == "pruning" else ("same", "two"):
        got = runs[f"{scheme}_{case}"]
        if case == "2x2":  # replicas split each micro-batch's rows: gradients add up in another order
            assert all(abs(a - b) <= 1e-5 * b for a, b in zip(_losses(got), _losses(whole))), (scheme, case)
        else:
            assert _losses(got) == _losses(whole), (scheme, case)
        assert [r[key] for r in got] == [r[key] for r in whole], (scheme, case)
        if scheme == "freezing":
            assert [r["plasticity"] for r in got] == [r["plasticity"] for r in whole], case
        elif case != "2x2":  # (the kept set is a top-k of weights that differ in the last bits there)
            assert [r["layer_density"] for r in got] == [r["layer_density"] for r in whole], case
    assert runs[f"{scheme}_two"][-1]["stages"] == 2


@pytest.mark.parametrize("scheme", ["early_exit", "mod", "moe"])
def test_other_schemes_resume_exactly(runs, scheme):
    whole, got = runs[f"{scheme}_whole"], runs[f"{scheme}_same"]
    assert _losses(got) == _losses(whole)
    assert [r.get("predicted_cost") for r in got] == [r.get("predicted_cost") for r in whole]
    if scheme == "moe":  # routed by the selection bias the checkpoint saved
        assert [r["expert_counts"] for r in got] == [r["expert_counts"] for r in whole]


def test_a_checkpoint_after_a_repack_resumes_on_the_launch_layout_and_on_the_surviving_ranks(runs):
    whole = runs["repack_whole"]
    packed = [r for r in whole if r.get("released_ranks")]
    assert len(packed) == 1 and packed[0]["step"] == 2 and set(packed[0]["released_ranks"]) == {1, 2}
    ckpt = Path(runs["tmp"]) / "repack" / "whole" / "ckpt-0000003"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["layout"]["active"] == {"pp": 2, "world_size": 2, "ranks": [0, 3]}
    assert sorted(state["ranks"]) == ["0", "3"]  # the released ranks wrote nothing and were not waited for
    sizes = whole[2]["sizes"]
    for case in ("same", "two"):
        got = runs[f"repack_{case}"]
        assert _losses(got) == _losses(whole), case
        assert [r["sizes"] for r in got[3:]] == [r["sizes"] for r in whole[3:]] and got[3]["sizes"] == sizes


def test_freezing_snapshots_of_expert_shards_resume_under_another_expert_parallel_size(runs):
    whole, got = runs["freezing_ep_whole"], runs["freezing_ep_two"]
    assert whole[2]["frozen_layers"] > 0
    # a frozen MoE layer stays put: its expert replicas take no gradient, so Agg gives its owner none either
    for before, now in zip(whole, whole[1:]):
        if now["plasticity"] != before["plasticity"]:  # a check after some layers were frozen
            assert all(x == 0.0 for x in now["plasticity"][:before["frozen_layers"]]), now["plasticity"]
    ckpt = Path(runs["tmp"]) / "freezing_ep" / "whole" / "ckpt-0000003"
    extra = json.loads((ckpt / "manifest.json").read_text())["extra"]
    rows = [n for n in extra if ".snapshot:block_sparse_moe.experts." in n and n.endswith(".w1")]
    assert len(rows) == 4 * 4 and "dynamism.layers.3.snapshot:block_sparse_moe.experts.3.w1" in rows
    assert {extra[n]["file"] for n in rows} == {"extra-r00000.safetensors", "extra-r00001.safetensors",
                                                 "extra-r00002.safetensors", "extra-r00003.safetensors"}
    # another expert-parallel size sums expert rows and gradients in another order: the last bits only, since the
    # ranks of a stage split each micro-batch (not the batch), so every micro-batch's load-balancing loss is the
    # same under both layouts (split batch-first, the micro-batches held other rows: 2e-5 apart by step 6)
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(_losses(got), _losses(whole))), (_losses(got), _losses(whole))
    assert [r["frozen_layers"] for r in got] == [r["frozen_layers"] for r in whole]
    # the step-4 check is the first after the resume and measures against the restored snapshots: exact (to the
    # 6 logged decimals); later checks measure the diverging trajectories' own snapshots
    assert got[3]["plasticity"] == whole[3]["plasticity"]



def test_pruning_masks_of_expert_shards_resume_under_the_same_and_another_expert_parallel_size(runs):
    """2 stages x 2 expert shards: the masks of expert rows go by logical expert (each rank writes its rows) and
    resume exactly on the same layout; on 2 ranks (each stage every expert) the restored masks hold, and the
    step-4 pruning after the resume keeps the share of every layer (expert rows and gradients sum in another
    order there: losses to 1e-6)."""
    whole = runs["pruning_ep_whole"]
    assert whole[2]["sparsity_target"] > 0 and whole[5]["sparsity_target"] > whole[2]["sparsity_target"]
    same, two = runs["pruning_ep_same"], runs["pruning_ep_two"]
    assert _losses(same) == _losses(whole)
    assert [r["layer_density"] for r in same] == [r["layer_density"] for r in whole]
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(_losses(two), _losses(whole))), (_losses(two), _losses(whole))
    assert two[2]["layer_density"] == whole[2]["layer_density"]  # the restored masks
    # the step-4 pruning, the first after the resume, on weights that differ in the last bits: a near tie may flip
    assert all(abs(a - b) <= 1e-3 for a, b in zip(two[3]["layer_density"], whole[3]["layer_density"]))
    ckpt = Path(runs["tmp"]) / "pruning_ep" / "whole" / "ckpt-0000003"
    extra = json.loads((ckpt / "manifest.json").read_text())["extra"]
    rows = [n for n in extra if ".mask:block_sparse_moe.experts." in n and n.endswith(".w1")]
    assert len(rows) == 4 * 4 and "dynamism.layers.3.mask:block_sparse_moe.experts.3.w1" in rows
    assert {extra[n]["file"] for n in rows} == {f"extra-r{r:05d}.safetensors" for r in range(4)}


def test_a_checkpoint_with_layer_halves_on_two_stages_resumes_exactly(runs):
    whole, got = runs["split_whole"], runs["split_same"]
    assert whole[0]["sizes"] == [4, 4] and whole[2]["sizes"] == [3, 5]
    assert whole[2]["stage_layers"] == [1.5, 2.5]
    assert _losses(got) == _losses(whole)
    assert [r["sizes"] for r in got] == [r["sizes"] for r in whole]
