"""Fully sharded model state (`parallel.shard: full`: FSDP2 per layer over each stage's ranks) in a pipeline
against the unsharded pipeline on 4 gloo ranks: losses, gradient norms and parameters within 1e-5 relative
(fp32) with forced migrations (between steps, and between a backward pass and its optimizer step: gradients
travel), for pp 2 x dp 2 (1F1B), pp 2 x ep 2 (expert-parallel experts under the expert optimizer, Pro-Prophet
replicas, the moe dynamism scheme) and pp 2 x dp 2 with planned micro-batches (every rank of a stage in
lockstep); re-packing onto fewer stages (pp 4, and pp 3 x dp 2 on 6 ranks) and a resume after it; refusals of
what is not built."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline_sharded import MIGRATE, STEPS, _rel, pair, pipe_cfg


def _run(shard: str) -> dict[str, Any]:
    from moebal.pipeline.observe import static_bytes
    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(pipe_cfg(shard, 1), **MIGRATE)
    out = runner.train(STEPS)
    opt = runner.optimizer
    assert opt is not None
    grads, state = opt.shard_tensors() if shard == "full" else ([], [v for s in opt.state.values()  # type: ignore
                                                                          for v in s.values()])
    return {"records": out.records, "sizes": out.final_sizes, "optimizer": type(opt).__name__,
            "state_elems": sum(t.numel() for t in state if t.dim() > 0),
            "param_elems": sum(p.numel() for p in runner.full_state().values()),
            "params": runner.full_state(), "static": static_bytes(runner.stage, opt),
            # what the sharded parameters were made from keeps no storage beside the shards
            "unsharded_left": sum(old.numel() for old in getattr(opt, "_was", {}).values()
                                  if not any(old is p for p in runner.stage.parameters()))}


def _pairs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return pair(_run("none"), _run("full"), "full")


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return run_ranks(_pairs, 4, timeout_s=900)


def test_fully_sharded_pipeline_with_migrations_matches_unsharded(pairs):
    for r in pairs:
        plain, full = r["none"], r["full"]
        assert (plain["optimizer"], full["optimizer"]) == ("AdamW", "StageShardedAdamW")
        assert plain["sizes"] == full["sizes"] == [2, 2]
        assert [x["step"] for x in full["records"]] == list(range(1, STEPS + 1))
        for a, b in zip(plain["records"], full["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"],
                                                                                 b["grad_norm"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert r["param_rel"] < 1e-5, r["param_rel"]
        # the stage's AdamW moments are split over its 2 ranks: half of the unsharded ones (+ padding)
        whole, got = plain["state_elems"], full["state_elems"]
        assert whole == 2 * plain["param_elems"] and got <= whole // 2 + 64, (got, whole)
        assert full["static"] < plain["static"]
        assert full["unsharded_left"] == 0, full["unsharded_left"]
    rec = pairs[0]["full"]["records"]
    assert [x["migration"] for x in rec if "migration" in x] == ["forced", "forced-mid", "forced"]


COMPOSED_STEPS = 8
COMPOSED_MIGRATE = {"force": ((3, (1, 3)), (6, (2, 2))), "force_mid": ((5, (3, 1)),)}
"""Layer moves of the composed cases (8 steps): after steps 3 and 6, and inside step 5."""


def _composed_cfg(shard: str, case: str) -> Any:
    """pp 2 x ep 2 with replicating Pro-Prophet placements and the moe scheme (`ep2`), or pp 2 x dp 2 with planned
    micro-batches and no MoE routing losses (`planned`: only `shard: full` puts the stage's ranks in lockstep)."""
    from moebal.config import from_dict

    ep2 = case == "ep2"
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop",
                "aux_loss_coef": 0.01 if ep2 else 0.0},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": COMPOSED_STEPS, "warmup_steps": 2, "lr": 3e-3, "eval_every": 0, "precision": "fp32",
                  "grad_clip": 0.5, "threads": 1, "progress": "plain"},
        "parallel": {"pp": 2, "ep": 2 if ep2 else 1, "nproc": 4, "shard": shard},
        # a fixed hardware profile and no hysteresis: the same placements in every run, and they replicate
        "planner": {"policy": "broadcast_topk" if ep2 else "static", "costs": "rtx3090", "hysteresis": 0.0},
        "pipeline": {"micro_batches": 2, "schedule": "1f1b",
                     **({} if ep2 else {"microbatching": "dynamic", "dynamic": {"costs": "a100", "workers": 0}})},
        "dynamism": {"scheme": "moe" if ep2 else "none"}})


def _composed_run(shard: str, case: str) -> dict[str, Any]:
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.planned import PlannedPipelineRunner
    from moebal.pipeline.runner import PipelineRunner

    cfg = _composed_cfg(shard, case)
    cls = PipelineRunner if case == "ep2" else PlannedPipelineRunner
    runner = cls(cfg, scheme=build_dynamism(cfg.dynamism.scheme, {}, cfg=cfg), **COMPOSED_MIGRATE)
    out = runner.train(COMPOSED_STEPS)
    lock = getattr(runner, "lockstep", None)
    return {"records": out.records, "sizes": out.final_sizes, "optimizer": type(runner.optimizer).__name__,
            "params": runner.full_state(), "lockstep": None if lock is None else (lock.replicas, lock.ranks)}


def _composed(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case in ("ep2", "planned"):
        out[case] = pair(_composed_run("none", case), _composed_run("full", case), "full")
    return out


@pytest.fixture(scope="module")
def composed() -> list[dict[str, Any]]:
    return run_ranks(_composed, 4, timeout_s=900)


def _check_composed(runs: list[dict[str, Any]], case: str) -> None:
    for r in runs:
        plain, full = r[case]["none"], r[case]["full"]
        assert full["optimizer"] == "StageShardedAdamW" and plain["sizes"] == full["sizes"] == [2, 2]
        assert [x["step"] for x in full["records"]] == list(range(1, COMPOSED_STEPS + 1))
        for a, b in zip(plain["records"], full["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (case, a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (case, a["step"], a["grad_norm"],
                                                                                 b["grad_norm"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert r[case]["param_rel"] < 1e-5, (case, r[case]["param_rel"])
        assert [x["migration"] for x in full["records"] if "migration" in x] == ["forced", "forced-mid", "forced"]


def test_fully_sharded_pipeline_with_expert_parallel_stages_and_replicas_matches_unsharded(composed):
    """pp 2 x ep 2: dense state FSDP2's over the stage's 2 ranks, each rank's expert shard whole under the expert
    optimizer (over "dp": 1 rank here), Trans and Agg of replicated experts, the moe scheme's cost factors."""
    _check_composed(composed, "ep2")
    replicas = [sum(x["replicas"]) for x in composed[0]["ep2"]["full"]["records"]]
    assert sum(replicas) > 0, replicas  # Trans and Agg of replicated experts ran
    assert replicas == [sum(x["replicas"]) for x in composed[0]["ep2"]["none"]["records"]]
    for r in composed:  # the moe scheme's per-layer cost factors, the same from the sharded stages
        for a, b in zip(r["ep2"]["none"]["records"], r["ep2"]["full"]["records"]):
            assert len(b["predicted_cost"]) == 4 and b["predicted_cost"] == a["predicted_cost"], a["step"]


def test_fully_sharded_pipeline_with_planned_micro_batches_runs_the_stage_in_lockstep(composed):
    _check_composed(composed, "planned")
    for r in composed:  # without MoE routing losses only `shard: full` makes the stage's 2 ranks one lockstep
        assert r["planned"]["full"]["lockstep"] == (1, 2) and r["planned"]["none"]["lockstep"] == (2, 1)


@pytest.mark.parametrize("scheme", ["pruning", "freezing", "early_exit", "mod", "sparse_attention"])
def test_fully_sharded_pipeline_takes_every_dynamism_scheme(scheme):
    """Nothing is refused (the cells' parity: tests/distributed/test_pipeline_sharded_schemes.py)."""
    assert pipe_cfg("full", 1, dynamism=scheme).dynamism.scheme == scheme


def test_fully_sharded_pipeline_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    """The resume parity of `test_pipeline_sharded.resume_parity` under `shard: full`; checkpoint rows are written
    by their owners."""
    from tests.distributed.test_pipeline_sharded import resume_parity

    manifest = resume_parity(tmp_path, "full")
    pieced = {k: e for k, e in manifest["tensors"].items() if k.endswith(":exp_avg") and "pieces" in e}
    writers = {p["file"] for e in pieced.values() for p in e["pieces"]}
    assert pieced and all(len(e["pieces"]) == 2 for e in pieced.values())  # rows written by the 2 owners
    assert len(writers) == 4, writers  # each stage's AdamW state written by its owners, every rank a part


def _ep_leg(rank: int, world: int, root: str, resume: bool, stop: int | None) -> list[dict[str, Any]]:
    from tests.distributed.test_pipeline_sharded import _leg

    return _leg(rank, world, root, "full", resume, stop, ep=2)


def test_fully_sharded_expert_parallel_pipeline_resumes_like_an_uninterrupted_run(tmp_path):
    """pp 2 x ep 2 under `full`: 6 steps with migrations in one go against 4 steps, a stop and a resume from the
    step-4 checkpoint (dense row pieces and the expert optimizer's state, written by their owners, under a
    migrated partition); losses, gradient norms and the last checkpoint's weights and moments within 1e-5."""
    from pathlib import Path

    from tests.distributed.shard_parity import checkpoint_state

    whole = run_ranks(_ep_leg, 4, str(tmp_path / "whole"), False, None, timeout_s=600)[0]
    run = str(tmp_path / "resumed")
    run_ranks(_ep_leg, 4, run, False, 4, timeout_s=600)
    resumed = run_ranks(_ep_leg, 4, run, True, None, timeout_s=600)[0]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(whole, resumed):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), a["step"]
    ref, got = (checkpoint_state(Path(d) / "ckpt-0000006") for d in (tmp_path / "whole", run))
    assert ref.keys() == got.keys() and any(k.endswith(":exp_avg") and "experts" in k for k in ref)
    worst = max(_rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0)
    assert worst < 1e-5, worst


# ---- re-packing onto fewer stages ------------------------------------------------------------------------------

REPACK_STEPS = 8


def _repack_run(shard: str, pp: int) -> dict[str, Any]:
    """A pipeline of `pp` stages re-packed onto 2 after step 3 (the middle stages' layers move to the first and
    last with their shards and AdamW state; their ranks are released and stop)."""
    import torch.distributed as dist

    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(pipe_cfg(shard, 1, steps=REPACK_STEPS, pp=pp), force=((3, (2, 2)),))
    out = runner.train(REPACK_STEPS)
    res = {"records": out.records, "released": out.released, "released_at": out.released_at,
           "sizes": out.final_sizes, "optimizer": type(runner.optimizer).__name__,
           "params": {} if out.released else runner.full_state()}
    dist.barrier()  # released ranks wait here until the survivors have finished
    return res


def _repack_pair(rank: int, world: int, pp: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return pair(_repack_run("none", pp), _repack_run("full", pp), "full")


def _check_repack(runs: list[dict[str, Any]], released: int) -> None:
    assert sum(r["full"]["released"] for r in runs) == released
    for r in runs:
        plain, full = r["none"], r["full"]
        assert plain["released"] == full["released"] and plain["sizes"] == full["sizes"]
        if full["released"]:  # stopped after the re-pack's step, holding nothing
            assert full["released_at"] == 3 and full["optimizer"] == "NoneType" and len(full["records"]) == 3
            continue
        assert full["optimizer"] == "StageShardedAdamW" and full["sizes"] == [2, 2]
        assert [x["step"] for x in full["records"]] == list(range(1, REPACK_STEPS + 1))
        for a, b in zip(plain["records"], full["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), a["step"]
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert [x.get("migration") for x in full["records"]][2] == "forced"
        assert r["param_rel"] < 1e-5, r["param_rel"]


def test_fully_sharded_pipeline_repacks_like_unsharded():
    """pp 4 on 4 ranks (one rank per stage) re-packed onto 2 stages: the released ranks' layers arrive on the
    first and last stage and are sharded there; losses, gradient norms and parameters as unsharded."""
    _check_repack(run_ranks(_repack_pair, 4, 4, timeout_s=600), released=2)


def test_fully_sharded_pipeline_with_data_parallel_stages_repacks_like_unsharded():
    """pp 3 x dp 2 on 6 ranks: the released stage's 2-rank FSDP2 mesh gathers its layer whole (the moments too)
    and both of its ranks stop; the last stage's 2 ranks shard the arriving layer over their own mesh."""
    _check_repack(run_ranks(_repack_pair, 6, 3, timeout_s=600), released=2)


def _repack_leg(rank: int, world: int, root: str, shard: str, resume_from: str | None) -> list[dict[str, Any]] | None:
    """6 steps of pp 4 on 4 ranks that the layer balancer re-packs onto 2 stages at step 2 (`pipeline.repack`),
    checkpoints at steps 3 and 6; `resume_from`: a copy of that run's directory as it stood after step 3."""
    from moebal.config import from_dict, to_dict
    from tests.distributed.test_pipeline_resume import _interrupted
    from tests.distributed.test_pipeline_resume import _run as run_trainer

    base = pipe_cfg(shard, 1, steps=6, pp=4, ckpt_every=3, keep_checkpoints=10)
    cfg = from_dict({**to_dict(base), "pipeline": {"micro_batches": 2, "repack": True, "repack_slack": 100.0,
                                                      "every": 2}})
    torch.set_num_threads(1)
    if resume_from is None:
        return run_trainer(rank, cfg, Path(root))
    return run_trainer(rank, cfg, _interrupted(rank, Path(resume_from), Path(root)), resume=True)


def test_fully_sharded_pipeline_resumes_after_a_repack(tmp_path):
    """The layer balancer's re-pack under `shard: full` against `shard: none` (losses within 1e-5), and the full
    run's step-3 checkpoint (written by the 2 ranks still training) resumed on the launch layout: it re-packs again
    at once and continues as the uninterrupted run."""
    plain = run_ranks(_repack_leg, 4, str(tmp_path / "none"), "none", None, timeout_s=600)[0]
    full = run_ranks(_repack_leg, 4, str(tmp_path / "full"), "full", None, timeout_s=600)[0]
    resumed = run_ranks(_repack_leg, 4, str(tmp_path / "resumed"), "full", str(tmp_path / "full"),
                        timeout_s=600)[0]
    packed = [r for r in full if r.get("released_ranks")]
    assert len(packed) == 1 and packed[0]["step"] == 2 and set(packed[0]["released_ranks"]) == {1, 2}
    state = json.loads((tmp_path / "full" / "ckpt-0000003" / "state.json").read_text())
    assert sorted(state["ranks"]) == ["0", "3"]
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == list(range(1, 7))
    for a, b, c in zip(plain, full, resumed):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["loss"] == c["loss"] and b["grad_norm"] == c["grad_norm"], (b["step"], b["loss"], c["loss"])
    assert [r["sizes"] for r in resumed[3:]] == [r["sizes"] for r in full[3:]]


# ---- split layers (`pipeline.split_layers`) ------------------------------------------------------------------

SPLIT_STEPS = 7
SPLIT_MIGRATE = {"force": ((2, (4, 2)), (6, (3, 3))), "force_mid": ((4, (1, 5)),)}
"""Units 0a 0f 1 2a 2f 3 (layers 1 and 3 MoE, whole): after step 2 layer 2's attention half joins stage 0 (its FFN
half stays, re-sharded); inside step 4 (gradients travel) 0f, 1 and 2a go to stage 1, where 2a joins the sharded
2f; after step 6 back to the start."""


SPLIT_SPARSE = {"scheme": "sparse_attention",
                "sparse_attention": {"block": 4, "budget": "random_walk", "min_density": 0.2, "start": 1}}
"""Dynamic sparse attention from step 2: the split layers' attention halves run the scheme's sparse core
(`Dynamism.attention_half`) inside their attention module's FSDP2 unit."""


def _split_run(shard: str, dynamism: dict[str, Any] | None = None, recompute: str = "none") -> dict[str, Any]:
    from moebal.config import from_dict, to_dict
    from moebal.pipeline.runner import PipelineRunner
    from moebal.train.pipelined import scheme_from_config

    base = to_dict(pipe_cfg(shard, 1, steps=SPLIT_STEPS))
    cfg = from_dict({**base, "moe": {**base["moe"], "every": 2}, "train": {**base["train"], "recompute": recompute},
                     "pipeline": {**base["pipeline"], "split_layers": True}, "dynamism": dynamism or base["dynamism"]})
    runner = PipelineRunner(cfg, scheme=scheme_from_config(cfg), **SPLIT_MIGRATE)
    out = runner.train(SPLIT_STEPS)
    units = [type(m).__name__ for m in runner.stage.modules() if "FSDP" in type(m).__name__]
    return {"records": out.records, "sizes": out.final_sizes, "optimizer": type(runner.optimizer).__name__,
            "params": runner.full_state(), "fsdp_units": units, "first": runner.chain.is_first}


def _split_pair(rank: int, world: int, dynamism: dict[str, Any] | None = None,
                recompute: str = "none") -> dict[str, Any]:
    torch.set_num_threads(1)
    return pair(_split_run("none", dynamism), _split_run("full", dynamism, recompute), "full")


@pytest.mark.parametrize("dynamism,recompute", [(None, "none"), (SPLIT_SPARSE, "none"), (SPLIT_SPARSE, "full")],
                         ids=["none", "sparse_attention", "sparse_attention-recompute"])
def test_fully_sharded_pipeline_with_split_layers_matches_unsharded(dynamism, recompute):
    """pp 2 x dp 2, `pipeline.split_layers` (the dense layers 0 and 2 run as attention and FFN halves, each
    half's norm, attention and MLP its own FSDP2 unit), forced moves of halves between steps and inside one:
    losses, gradient norms and parameters within 1e-5 of the unsharded pipeline; with no scheme and with dynamic
    sparse attention (whose attention halves run the sparse core), and with it under `train.recompute: full` in
    the sharded run only (the attention halves replayed inside their FSDP2 units, against the run without)."""
    runs = run_ranks(_split_pair, 4, dynamism, recompute, timeout_s=600)
    for r in runs:
        plain, full = r["none"], r["full"]
        assert full["optimizer"] == "StageShardedAdamW" and plain["sizes"] == full["sizes"] == [3, 3]
        assert [x["step"] for x in full["records"]] == list(range(1, SPLIT_STEPS + 1))
        for a, b in zip(plain["records"], full["records"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["step"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a["step"], a["grad_norm"],
                                                                                 b["grad_norm"])
            assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
            assert a["stage_layers"] == b["stage_layers"]
        assert [x["migration"] for x in full["records"] if "migration" in x] == ["forced", "forced-mid", "forced"]
        assert full["records"][2]["stage_layers"] == [2.5, 1.5]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert r["param_rel"] < 1e-5, r["param_rel"]
        if dynamism is not None:  # the sparse core ran (below density 1 from step 2)
            assert all(min(x["attention_density"]) < 1.0 for x in full["records"][1:])
        # 0a 0f | 1 | embedding (first stage), 2a 2f | 3 | norm, head (last): a split layer's 4 submodules
        assert len(full["fsdp_units"]) == (6 if full["first"] else 7) and not plain["fsdp_units"], full["fsdp_units"]


# ---- the zero-bubble schedule -----------------------------------------------------------------------------------

ZB_STEPS = 6
ZB_MIGRATE = {"force": ((2, (1, 3)),), "force_mid": ((4, (3, 1)),)}
"""A move after step 2 and one inside step 4 (the W ops' reduced gradients travel)."""


def _zb_run(shard: str, schedule: str, ep: int) -> dict[str, Any]:
    from moebal.pipeline.runner import PipelineRunner

    runner = PipelineRunner(pipe_cfg(shard, ep, steps=ZB_STEPS, schedule=schedule), **ZB_MIGRATE)
    out = runner.train(ZB_STEPS)
    return {"records": out.records, "sizes": out.final_sizes, "optimizer": type(runner.optimizer).__name__,
            "params": runner.full_state()}


def _zb_cases(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for ep in (1, 2):
        runs = {"full_zb": _zb_run("full", "zb", ep), "full_1f1b": _zb_run("full", "1f1b", ep),
                "none_zb": _zb_run("none", "zb", ep)}
        ref = runs["full_zb"]["params"]
        out[f"ep{ep}"] = {"rel": {k: max((_rel(ref[n], r["params"][n]) for n in ref if r["params"][n].norm() > 0),
                                         default=0.0) for k, r in runs.items() if k != "full_zb"},
                          **{k: {x: v for x, v in r.items() if x != "params"} for k, r in runs.items()}}
    return out


@pytest.fixture(scope="module")
def zb_cases() -> list[dict[str, Any]]:
    return run_ranks(_zb_cases, 4, timeout_s=900)


@pytest.mark.parametrize("case", ["ep1", "ep2"])
def test_fully_sharded_pipeline_with_zero_bubble_matches_1f1b_and_unsharded(zb_cases, case):
    """pp 2 x dp 2 (`ep1`) and pp 2 x ep 2 (`ep2`: the experts outside FSDP2) under the zero-bubble schedule with
    `shard: full`: the W ops' deferred Linear weight gradients reduce-scattered by hand into the FSDP2 shards
    (`DeferredGradReducer`), against 1F1B under `full` (FSDP2 reduces them in B) and zero bubble unsharded:
    losses, gradient norms and parameters within 1e-5 relative, with a migration between steps and one between a
    backward pass and its optimizer step."""
    for r in zb_cases:
        c = r[case]
        zb, f1, plain = c["full_zb"], c["full_1f1b"], c["none_zb"]
        assert zb["optimizer"] == f1["optimizer"] == "StageShardedAdamW" and plain["optimizer"] == "AdamW"
        assert zb["sizes"] == f1["sizes"] == plain["sizes"] == [3, 1]
        assert [x["step"] for x in zb["records"]] == list(range(1, ZB_STEPS + 1))
        assert all(x["stage_w_cpu_s"] and min(x["stage_w_cpu_s"]) > 0 for x in zb["records"])  # W ops ran
        assert not any(any(x["stage_w_cpu_s"]) for x in f1["records"])
        for ref in (f1, plain):
            for a, b in zip(ref["records"], zb["records"]):
                assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (case, a["step"], a["loss"], b["loss"])
                assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (case, a["step"])
                assert a.get("migration") == b.get("migration") and a["sizes"] == b["sizes"]
        assert any(x["grad_norm"] > 0.5 for x in plain["records"])  # the clip acted
        assert max(c["rel"].values()) < 1e-5, (case, c["rel"])
        if case == "ep1":  # FSDP2's reduce-scatters by hand in W add what B's would: bit for bit
            assert [x["loss"] for x in zb["records"]] == [x["loss"] for x in f1["records"]]
            assert [x["grad_norm"] for x in zb["records"]] == [x["grad_norm"] for x in f1["records"]]


def _reducer_ranks(rank: int, world: int) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from moebal.distributed.fsdp import DeferredGradReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))  # 5 rows over 3 ranks; 2 < 3
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    fully_shard(model, mesh=mesh)
    reducer = DeferredGradReducer(model, mesh, torch.float32)
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert len(params) == 4 and reducer.holds(params[0])

    def grads(r: int, k: int) -> list[torch.Tensor]:  # what rank r's W op k computes, whole
        gen = torch.Generator().manual_seed(100 * k + r)
        return [torch.randn(p.shape, generator=gen) for p in params]

    errs = []
    for k in range(2):  # two W ops: the second adds to the first's shards
        for p, g in zip(params[::-1], grads(rank, k)[::-1]):  # any order in: the stage's order out
            reducer.add(p, g)
        reducer.add(params[0], grads(rank, k)[0])  # a weight used twice in one micro-batch: summed
        reducer.flush()
        assert reducer.pending() == 0
    for i, p in enumerate(params):
        want = sum(grads(r, k)[i] * (2 if i == 0 else 1) for r in range(world) for k in range(2))
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        errs.append(float((p.grad.full_tensor() - want).abs().max()))
    return errs


def test_deferred_grad_reducer_sums_whole_gradients_into_fsdp2_shards_of_uneven_rows():
    """`DeferredGradReducer` on 3 ranks: whole gradients of a 5-row and a 2-row weight (uneven and empty shards)
    and their biases, two W ops, one weight added twice: each rank's shard gradient, gathered, is the sum over
    ranks and W ops (to float rounding)."""
    for errs in run_ranks(_reducer_ranks, 3, timeout_s=120):
        assert max(errs) < 1e-5, errs


# ---- bf16 weights (`parallel.param_dtype: bf16`) --------------------------------------------------------------

def _bf16_weights(rank: int, world: int) -> dict[str, Any]:
    """pp 2 x dp 2 under `full` and bf16 autocast: fp32 weights, then FSDP2's bf16 policy (the stream between
    the stages then leaves a layer in bf16 while the next stage expects the fp32 it was built with)."""
    import dataclasses

    from moebal.pipeline.runner import PipelineRunner

    torch.set_num_threads(1)
    out = {}
    for dtype in ("fp32", "bf16"):
        cfg = pipe_cfg("full", 1, steps=6, precision="bf16")
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=dtype))
        out[dtype] = PipelineRunner(cfg, force=((3, (1, 3)),)).train(6).records
    return out


def test_fully_sharded_pipeline_with_bf16_weights_matches_fp32_weights_under_autocast():
    """FSDP2's bf16 policy in a pipeline: 6 steps with a migration, losses within 2 % of the fp32-weight run (the
    activations cross the stages in the dtype every stage allocates: `PipelineEngine._wire`)."""
    out = run_ranks(_bf16_weights, 4, timeout_s=600)[0]
    assert [x.get("migration") for x in out["bf16"]][2] == "forced"
    for a, b in zip(out["fp32"], out["bf16"], strict=True):
        assert math.isfinite(b["loss"]) and math.isclose(a["loss"], b["loss"], rel_tol=0.02), (a, b)
    assert [a["loss"] for a in out["fp32"]] != [b["loss"] for b in out["bf16"]]
